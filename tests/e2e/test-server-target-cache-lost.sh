#!/usr/bin/env bash
# A `server`-cache target whose store server restarts: the cache died with the server
# process, so the agent must not wait for it forever. The guest's read that was waiting
# during the outage fails with EIO within a few seconds of the restarted server listening
# (docs/AGENT.md: one reconnect round, at most the 2 s backoff + 25%), and so does every
# later request at once; `target status` (text and JSON) says the cache is lost; the
# server logs the refused reconnect; one SIGTERM ends the agent, which removes its socket.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=server-lib.sh
source "$E2E_DIR/server-lib.sh"
# shellcheck source=agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
require nbdsh nbdinfo qemu-io
require_python_nbd
require_vdstream
is_vdstream || skip "target/ID is vdstream's"
e2e_init
store_init

golden_vdisk w 16
vds target add s1 --vdisk w --cache server >/dev/null
start_store_server
srv=$SOCK
start_agent s1 --server "$(xuri target/s1 "$srv")" --cache server
pid_s1=$AGENT_PID sock_s1=$AGENT_SOCK

# The guest writes, and reads its write back, through the server's cache.
nbdsh_script '
h.pwrite(b"\xab" * 65536, 1 << 20)
assert h.pread(65536, 1 << 20) == b"\xab" * 65536
' || fail "write and read back through the server cache"
log "ok: the guest writes through the server cache"

# The server goes (SIGKILL), a guest read waits for it, the server comes back.
kill -KILL "$SERVER_PID"
wait "$SERVER_PID" 2>/dev/null || true
timeout 60 nbdsh -u "$URI" -c '
import errno, time
t = time.time()
try:
    h.pread(4096, 1 << 20)
    print("read-ok", time.time())
except nbd.Error as e:
    print("read-error", e.errno if isinstance(e.errno, str) else errno.errorcode[e.errno], time.time(), e)
' >"$E2E_TMP/read1.out" 2>&1 &
read_pid=$!
track_pid "$read_pid"
sleep 1
start_store_server_on "$srv"
ready=$(date +%s.%N)
rc=0
wait "$read_pid" || rc=$?
[[ $rc -ne 124 ]] || fail "the guest's read still waits 60 s after the server restarted (the lost cache is waited for without a bound)"
read -r what errno_ at _ <"$E2E_TMP/read1.out" || true
[[ $what == read-error ]] || fail "the guest's read after the server lost the cache: $(cat "$E2E_TMP/read1.out")"
assert_eq "errno of the guest's read" "$errno_" EIO
late=$("$PY" -c "print(round($at - $ready, 2))")
"$PY" -c "import sys; sys.exit(0 if $late <= 8 else 1)" || fail "EIO came ${late}s after the server was back (bound: 2.5 s of backoff, plus slack)"
log "ok: the waiting read failed with EIO ${late}s after the server listened again"

# Later requests fail at once.
start=$(date +%s.%N)
out=$(timeout 30 nbdsh -u "$URI" -c '
import errno
try:
    h.pread(4096, 0)
    print("read-ok")
except nbd.Error as e:
    print("read-error", e.errno if isinstance(e.errno, str) else errno.errorcode[e.errno])
' 2>&1) || true
took=$("$PY" -c "import time; print(round(time.time() - $start, 2))")
[[ $out == "read-error EIO" ]] || fail "a new read after the cache was lost: $out"
"$PY" -c "import sys; sys.exit(0 if $took <= 5 else 1)" || fail "a new read took ${took}s to fail"
log "ok: a new read fails with EIO at once (${took}s, with nbdsh's own start)"

# The status says so, in text and JSON.
sleep 1.5   # the status file is rewritten every second
rc=0
text=$("$VDSTREAM_BIN" target status s1 2>"$E2E_TMP/status.err") || rc=$?
assert_eq "exit status of target status (6: unavailable)" "$rc" 6
grep -q "server lost its cache" "$E2E_TMP/status.err" || fail "target status does not say why it fails: $(cat "$E2E_TMP/status.err")"
[[ $text == *"CACHE LOST"* && $text == *"EIO"* ]] || fail "target status does not say the cache is lost: $text"
# `target status --json` prints the status and exits 6: the target's disk is unavailable.
lost_status_get() {
    local rc=0
    "$VDSTREAM_BIN" target status s1 --json >"$E2E_TMP/status.json" 2>/dev/null || rc=$?
    ((rc == 6)) || fail "target status s1 --json exits $rc, not 6 (unavailable)"
    json_get "$E2E_TMP/status.json" "$1"
}
assert_eq "status JSON state" "$(lost_status_get 'j["state"]')" "cache lost"
lost=$(lost_status_get 'j["server"]["lost"]')
[[ $lost == *"lost this target's cache"* && $lost == *"attach gone"* ]] || fail "status JSON server.lost: $lost"
gave_up=$(lost_status_get 'j["server"]["gave_up"]')
((gave_up >= 2)) || fail "status JSON server.gave_up: $gave_up"
log "ok: target status says: $(grep -m1 'CACHE LOST' <<<"$text")"

# The server logged the refusal, naming the client, the target and the reason.
grep -q "target s1: refused the reconnect of attach [a-z0-9]* from .*: its server cache is lost" "$SERVER_LOG" \
    || fail "the server did not log the refused reconnect: $(cat "$SERVER_LOG")"
log "ok: the server logged: $(grep -m1 'refused the reconnect' "$SERVER_LOG")"

# One SIGTERM ends the agent; it removes its socket and says it stopped.
rc=0
stop_server "$pid_s1" 10 || rc=$?
[[ $rc -ne 124 ]] || fail "one SIGTERM did not end the agent within 10 s: $(tail -n 5 "$E2E_TMP/agent-s1.log")"
[[ ! -e $sock_s1 ]] || fail "the agent left its socket $sock_s1 behind"
assert_eq "status after the agent left" "$(agent_status_get s1 'j["state"]')" "stopped"
log "ok: one SIGTERM ended the agent (exit status $rc), socket removed"

rc=0
stop_server "$SERVER_PID" 15 || rc=$?
assert_eq "server exit status" "$rc" 0
log "ok: a lost server cache gives EIO, a status and a log line, and a clean detach"
