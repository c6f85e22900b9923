#!/usr/bin/env bash
# Two vdstream servers on one store; an agent lists both. The one in use gets SIGTERM
# (drain) in the middle of an fio run: it finishes what it had read and exits 0, the agent
# moves to the other server, and fio finishes with zero errors and verification passes.
# With FAILOVER_SIGNAL=KILL (test-server-failover-kill.sh) the server is killed instead.
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
sig=${FAILOVER_SIGNAL:-TERM}

golden_vdisk w 128
start_store_server --name a
pid_a=$SERVER_PID sock_a=$SOCK
start_store_server --name b
sock_b=$SOCK
start_agent t2 --server "$(xuri vdisk/w "$sock_a")" --server "$(xuri vdisk/w "$sock_b")" --cache ram-overflow --ram 16M

run_fio_verify failover --rw=randrw --rwmixwrite=40 --bs=4k --size=96m --iodepth=16 \
    --rate_iops=4000 --number_ios=24000 &
fio_pid=$!
sleep 2
log "SIG$sig to the server in use (pid $pid_a)"
rc=0
SIGNAL=$sig stop_server "$pid_a" 15 || rc=$?
if [[ $sig == TERM ]]; then
    assert_eq "exit status of the drained server" "$rc" 0
fi
wait "$fio_pid" || fail "fio through the agent failed across the failover"
server_alive "$AGENT_PID" || fail "the agent died"
sleep 1.5
assert_eq "failovers" "$(agent_status_get t2 'j["server"]["failovers"]')" 1
assert_eq "connected" "$(agent_status_get t2 'j["server"]["connected"]')" True
grep -q "failover from" "$AGENT_LOG" || fail "the failover was not logged"
rc=0
stop_server "$AGENT_PID" 15 || rc=$?
assert_eq "agent exit status" "$rc" 0
