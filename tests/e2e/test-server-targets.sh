#!/usr/bin/env bash
# target/ID on `vdstream server --http`: a `server` target and a `server-persistent` one,
# each attached through an agent (which passes their writes through) to target/ID, run
# fio with crc32c verification; the server is SIGKILLed in the middle of two
# server-persistent runs and restarted on the same socket: fio finishes with zero errors
# and verification passes on both (the cache was reopened for the same attach). p1's agent
# journals what the server answered and sends it again to the restarted server (the
# server answers it without a sync per write); p2's agent runs with --journal-max 0, so the
# server makes each write durable before answering it. Around it:
# GET /api/v1/sessions shows each session's target, vDisk, version, cache type and use;
# an unknown target and a second live writer are refused with what to do; after the
# restart the `server` attach is refused as gone; a promote moves the next attach of a
# target, not the running one; a malformed API request gets 400; GET /api/v1/server and
# /metrics carry the read cache's figures and guest against store I/O. Last, with the
# server gone, a detaching agent waits for its last flush and a second SIGTERM ends it.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=server-lib.sh
source "$E2E_DIR/server-lib.sh"
# shellcheck source=agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
# shellcheck source=fio-verify.sh
source "$E2E_DIR/fio-verify.sh"
require fio nbdinfo curl qemu-io
require_vdstream
is_vdstream || skip "target/ID is vdstream's"
e2e_init
store_init

golden_vdisk w 64
v1=1   # golden_vdisk makes version 1, in production
vds target add s1 --vdisk w --cache server >/dev/null
vds target add p1 --vdisk w --cache server-persistent --overflow-max 48M >/dev/null
vds target add p2 --vdisk w --cache server-persistent --overflow-max 48M >/dev/null
vds target add d1 --vdisk w --cache device-disk >/dev/null

start_store_server --http 127.0.0.1:0
srv=$SOCK
api_url() { grep -Eo 'http://127\.0\.0\.1:[0-9]+' "$SERVER_LOG" | tail -n1; }
API=$(api_url)
[[ -n $API ]] || fail "the server did not print its HTTP address: $(cat "$SERVER_LOG")"

# --- bad input: an unknown target
r=$(refusal target/nosuch)
[[ $r == *"vdstream target add nosuch"* ]] || fail "unknown target: $r"
log "ok: unknown target refused: $r"

# --- a server target and a server-persistent one, through agents
start_agent s1 --server "$(xuri target/s1 "$srv")" --cache server
uri_s1=$URI pid_s1=$AGENT_PID
start_agent p1 --server "$(xuri target/p1 "$srv")" --cache server-persistent
uri_p1=$URI pid_p1=$AGENT_PID

# --- a second live writer is refused, naming the holder
r=$(refusal target/s1)
[[ $r == *"already has its one writer"* && $r == *"attach "* ]] || fail "second writer on target/s1: $r"
log "ok: second writer refused: $r"

URI=$uri_s1 run_fio_verify s1 --rw=randrw --rwmixwrite=50 --bs=4k --size=32m --iodepth=8 --number_ios=4000

# --- the sessions, in the API
curl -sS --max-time 10 "$API/api/v1/sessions" >"$E2E_TMP/sessions.json" || fail "GET /api/v1/sessions failed"
"$PY" - "$E2E_TMP/sessions.json" "$v1" <<'PYEOF' || fail "GET /api/v1/sessions: $(cat "$E2E_TMP/sessions.json")"
import json, sys
j = json.load(open(sys.argv[1]))
sessions = j["sessions"] if isinstance(j, dict) else j
by = {s["target"]: s for s in sessions if s.get("target")}
assert set(by) == {"s1", "p1"}, by.keys()
for t, kind in (("s1", "server"), ("p1", "server-persistent")):
    s = by[t]
    assert s["kind"] == "target" and s["vdisk"] == "w" and s["version"] == int(sys.argv[2]), s
    assert s["cache"]["type"] == kind and s["cache"]["limit_bytes"] > 0, s
assert by["s1"]["cache"]["used_bytes"] > 0 and by["s1"]["store"]["write_bytes"] > 0, by["s1"]
assert by["p1"]["cache"]["limit_bytes"] == 48 << 20, by["p1"]
print("sessions:", {t: (s["version"], s["cache"]["type"], s["cache"]["used_bytes"]) for t, s in by.items()})
PYEOF
log "ok: GET /api/v1/sessions shows both targets"
curl -sS --max-time 10 "$API/api/v1/server" >"$E2E_TMP/server.json" || fail "GET /api/v1/server failed"
"$PY" - "$E2E_TMP/server.json" <<'PYEOF' || fail "GET /api/v1/server: $(cat "$E2E_TMP/server.json")"
import json, sys
j = json.load(open(sys.argv[1]))
rc, io = j["read_cache"], j["io"]
assert rc["capacity_bytes"] > 0 and rc["misses"] > 0 and rc["used_bytes"] > 0, rc
assert io["guest"]["read_bytes"] > 0 and io["store"]["read_bytes"] > 0 and io["store"]["write_bytes"] > 0, io
print("read cache:", rc, "io:", io)
PYEOF
curl -sS --max-time 10 "$API/metrics" >"$E2E_TMP/metrics.txt" || fail "GET /metrics failed"
for m in vdstream_read_cache_hits_total vdstream_read_cache_misses_total vdstream_read_cache_used_bytes vdstream_store_read_bytes_total; do
    grep -Eq "^$m [0-9]" "$E2E_TMP/metrics.txt" || fail "/metrics has no $m"
done
log "ok: read-cache figures in /api/v1/server and /metrics"
attach_s1=$(grep -Eo 'target s1: new attach [a-z0-9]+' "$SERVER_LOG" | awk '{print $5}' | head -n1)
[[ -n $attach_s1 ]] || fail "no attach logged for s1"

# --- a promote: the running target keeps its version, the next attach gets the new one
v2=$(new_patched_version w production 1M 64k 0x77)
d1=$(nbdinfo --json "$(xuri target/d1 "$srv")" | json_get /dev/stdin 'j["exports"][0]["description"]')
[[ $d1 == "target/d1@v$v2 vdisk/w@$v2 "* ]] || fail "a new attach of d1 after the promote: $d1"
p1v=$(curl -sS --max-time 10 "$API/api/v1/sessions" | "$PY" -c '
import json, sys
j = json.load(sys.stdin); s = j["sessions"] if isinstance(j, dict) else j
print([x["version"] for x in s if x.get("target") == "p1"][0])')
assert_eq "version of the running p1 after the promote" "$p1v" "$v1"
log "ok: promote moved the next attach ($d1), not the running target"

# --- server-persistent across a SIGKILL of the server: with the agent's journal (p1), and
# without it (p2: the server writes through)
start_agent p2 --server "$(xuri target/p2 "$srv")" --cache server-persistent --journal-max 0
uri_p2=$URI pid_p2=$AGENT_PID
URI=$uri_p1 run_fio_verify p1 --rw=randrw --rwmixwrite=50 --bs=4k --size=32m --iodepth=8 \
    --rate_iops=2000 --number_ios=12000 &
fio_pid=$!
URI=$uri_p2 run_fio_verify p2 --rw=randrw --rwmixwrite=50 --bs=4k --size=32m --iodepth=8 \
    --rate_iops=1000 --number_ios=5000 &
fio2_pid=$!
sleep 2
log "SIGKILL to the server (pid $SERVER_PID)"
kill -KILL "$SERVER_PID"
sleep 1
start_store_server_on "$srv" --http 127.0.0.1:0
API=$(api_url)
wait "$fio_pid" || fail "fio through p1 (journal) failed across the server kill"
wait "$fio2_pid" || fail "fio through p2 (write-through) failed across the server kill"
server_alive "$pid_p1" || fail "the p1 agent died"
server_alive "$pid_p2" || fail "the p2 agent died"
sleep 1.5   # the agent rewrites its status file every second
for t in p1 p2; do
    reconnects=$(agent_status_get $t 'j["server"]["reconnects"]')
    ((reconnects >= 1)) || fail "the $t agent did not reconnect"
done
replayed=$(agent_status_get p1 'j["server"]["journal"]["replayed"]')
((replayed >= 1)) || fail "the p1 agent sent nothing again after the restart (journal: $(agent_status_get p1 'j["server"]["journal"]'))"
j2=$(agent_status_get p2 'j["server"].get("journal")')
[[ $j2 == None ]] || fail "p2 runs with --journal-max 0 but its status shows a journal: $j2"
grep -q "target p1: the agent journals its writes" "$SERVER_LOG" || fail "the restarted server did not take p1's journal marker: $(cat "$SERVER_LOG")"
if grep -q "target p2: the agent journals" "$SERVER_LOG"; then fail "the server dropped write-through for p2, whose agent keeps no journal"; fi
log "ok: server-persistent survived the kill, with the journal ($replayed changes sent again) and written through"

# --- the server attach died with the server
r=$(refusal "target/s1@$attach_s1")
[[ $r == *"is gone"* ]] || fail "the s1 attach after the restart: $r"
log "ok: the lost server cache is refused: $r"

# --- a malformed API request against the real server
code=$(curl -sS --max-time 10 -o "$E2E_TMP/bad.json" -w '%{http_code}' -X POST -H 'Content-Type: application/json' \
    --data-binary '{"id": "x", "vdisk": ' "$API/api/v1/targets")
assert_eq "status of a truncated JSON body" "$code" 400
code=$(curl -sS --max-time 10 -o /dev/null -w '%{http_code}' "$API/api/v1/targets/a..b")
[[ $code == 400 || $code == 404 ]] || fail "a bad target id in the path: $code"
log "ok: malformed API requests refused"

for p in "$pid_s1" "$pid_p1"; do stop_server "$p" 15 || true; done
rc=0
stop_server "$SERVER_PID" 15 || rc=$?
assert_eq "server exit status" "$rc" 0

# --- detaching with no server left: the last flush waits; a second SIGTERM leaves at once
kill -TERM "$pid_p2"
sleep 1.5
server_alive "$pid_p2" || fail "the p2 agent left without its last flush on the first SIGTERM: $(tail -n 5 "$E2E_TMP/agent-p2.log")"
rc=0
stop_server "$pid_p2" 5 || rc=$?
assert_eq "p2 agent's exit status after a second SIGTERM" "$rc" 1
grep -q "a second signal: leaving now" "$E2E_TMP/agent-p2.log" || fail "the agent did not say why it left: $(tail -n 5 "$E2E_TMP/agent-p2.log")"
[[ ! -e $VDSTREAM_RUN_DIR/p2.sock ]] || fail "the p2 agent left its socket behind"
log "ok: with no server, a second SIGTERM ends the agent's wait for its last flush"
log "ok: target exports"
