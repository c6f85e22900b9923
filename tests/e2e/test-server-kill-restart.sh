#!/usr/bin/env bash
# The vdstream server is killed with SIGKILL in the middle of an fio run through an agent
# and restarted on the same socket: fio finishes with zero errors and verification
# passes; the agent reconnected (to the version it started with: vdisk/w@1).
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
require fio nbdinfo
require_vdstream
e2e_init
store_init

golden_vdisk w 128
start_store_server
srv=$SOCK
start_agent t1 --server "$(xuri vdisk/w "$srv")" --cache ram-overflow --ram 16M

run_fio_verify kill --rw=randrw --rwmixwrite=40 --bs=4k --size=96m --iodepth=16 \
    --rate_iops=4000 --number_ios=24000 &
fio_pid=$!
sleep 2
log "SIGKILL to the server (pid $SERVER_PID)"
kill -KILL "$SERVER_PID"
sleep 1
start_store_server_on "$srv"
wait "$fio_pid" || fail "fio through the agent failed across the server kill"
sleep 1.5
reconnects=$(agent_status_get t1 'j["server"]["reconnects"]')
((reconnects >= 1)) || fail "the agent did not reconnect"
grep -q "reconnects ask for vdisk/w@1" "$AGENT_LOG" || fail "the agent did not pin vdisk/w@1"
grep -q "session: vdisk/w@1 from unix opened vdisk/w@1" "$SERVER_LOG" || fail "the agent did not come back to vdisk/w@1"
rc=0
stop_server "$AGENT_PID" 15 || rc=$?
assert_eq "agent exit status" "$rc" 0
