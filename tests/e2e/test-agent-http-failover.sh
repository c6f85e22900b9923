#!/usr/bin/env bash
# Two store servers with --http on one store; a device-disk target with a record attaches
# through their API URLs (no NBD URI, no cache flag), lands on the less busy server, runs
# fio verify=crc32c through the agent while the server in use is killed with SIGKILL:
# zero errors, and the other server's API shows the agent's report with the failover.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=server-lib.sh
source "$E2E_DIR/server-lib.sh"
# shellcheck source=agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
# shellcheck source=api-lib.sh
source "$E2E_DIR/api-lib.sh"
# shellcheck source=fio-verify.sh
source "$E2E_DIR/fio-verify.sh"
require fio nbdinfo curl
require_vdstream
e2e_init
store_init

golden_vdisk w 128
vds target add t1 --vdisk w --cache device-disk >/dev/null
start_store_server --name a --http 127.0.0.1:0
sock_a=$SOCK
server_api_url "$SERVER_LOG" "$SERVER_PID"
api_a=$API_URL
start_store_server --name b --http 127.0.0.1:0
pid_b=$SERVER_PID sock_b=$SOCK
server_api_url "$SERVER_LOG" "$SERVER_PID"
api_b=$API_URL

# Server a is busier: another agent reads from it over NBD.
start_agent busy --server "$(xuri vdisk/w "$sock_a")" --cache device-ram --ram 16M
API_URL=$api_a
for ((i = 0; i < 50; i++)); do
    [[ $(api GET /api/v1/server | head -n -1 | json_get /dev/stdin 'j["sessions"]') -ge 1 ]] && break
    sleep 0.1
done

start_agent t1 --server "$api_a" --server "$api_b"
grep -q "device-disk cache (from the record)" "$AGENT_LOG" || fail "the agent did not take the record's cache type: $(cat "$AGENT_LOG")"
in_use=$(agent_status_get t1 'j["server"]["endpoint"]')
[[ $in_use == *"$sock_b"* ]] || fail "the target went to $in_use, not to the less busy server b ($sock_b)"
log "ok: placed on b ($in_use)"
assert_eq "cache type" "$(agent_status_get t1 'j["cache"]["type"]')" device-disk

run_fio_verify http-failover --rw=randrw --rwmixwrite=40 --bs=4k --size=96m --iodepth=16 \
    --rate_iops=4000 --number_ios=24000 &
fio_pid=$!
sleep 2
log "SIGKILL to the server in use, b (pid $pid_b)"
SIGNAL=KILL stop_server "$pid_b" 15 || true
wait "$fio_pid" || fail "fio through the agent failed across the failover"
server_alive "$AGENT_PID" || fail "the agent died"

# The agent reports every second to the server it reads from, now a.
API_URL=$api_a
ok=
for ((i = 0; i < 50; i++)); do
    api GET /api/v1/targets/t1 >"$E2E_TMP/t1.out"
    head -n -1 "$E2E_TMP/t1.out" >"$E2E_TMP/t1.json"
    if [[ $(tail -n1 "$E2E_TMP/t1.out") == 200 ]] &&
        [[ $(json_get "$E2E_TMP/t1.json" 'j.get("agent", {}).get("server", {}).get("failovers", 0) >= 1 and j["agent"]["server"]["connected"]') == True ]]; then
        ok=1
        break
    fi
    sleep 0.2
done
[[ -n $ok ]] || fail "server a's API does not show t1's report with a failover: $(cat "$E2E_TMP/t1.out")"
log "ok: a's API shows t1: $(json_get "$E2E_TMP/t1.json" 'j["agent"]["server"]')"
api GET /api/v1/sessions | head -n -1 >"$E2E_TMP/sessions.json"
assert_eq "t1's session on a carries its report" \
    "$(json_get "$E2E_TMP/sessions.json" '[s["agent"]["server"]["failovers"] >= 1 for s in j if s["target"] == "t1" and s["agent"]]')" "[True]"
assert_eq "vDisk in the report" "$(json_get "$E2E_TMP/t1.json" 'j["agent"]["cache"]["type"]')" device-disk
"$VDSTREAM_BIN" target status t1 --server "$api_a" >"$E2E_TMP/status-api.txt" || fail "target status --server failed"
grep -Eq '[1-9][0-9]* failovers' "$E2E_TMP/status-api.txt" || fail "target status --server shows no failover: $(cat "$E2E_TMP/status-api.txt")"
rc=0
stop_server "$AGENT_PID" 15 || rc=$?
assert_eq "agent exit status" "$rc" 0
