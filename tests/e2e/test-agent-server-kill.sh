#!/usr/bin/env bash
# The server is killed with SIGKILL in the middle of an fio run through the agent, and
# restarted on the same socket 1 s later: fio (random reads and writes, crc32c verify,
# paced so that the kill lands mid-run) finishes with zero errors and verification passes;
# the agent reports at least one reconnect and re-sent requests, and no failover (there is
# one server). The base file is unchanged.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
# shellcheck source=fio-verify.sh
source "$E2E_DIR/fio-verify.sh"
require fio nbdinfo cmp
require_vdstream
e2e_init

MIB=128
base=$E2E_TMP/base.img
head -c $((MIB << 20)) /dev/urandom >"$base"
cp "$base" "$E2E_TMP/base.pristine"

start_server "$base" --read-only
srv_sock=$SOCK
start_agent t1 --server "nbd+unix:///?socket=$srv_sock" --cache ram-overflow --ram 16M

# 4 KiB random I/O, 40% writes, paced to ~6 s; reads of pages not yet written go to the server.
run_fio_verify kill --rw=randrw --rwmixwrite=40 --bs=4k --size=96m --iodepth=16 \
    --rate_iops=4000 --number_ios=24000 &
fio_pid=$!
sleep 2
log "SIGKILL to the server (pid $SERVER_PID)"
kill -KILL "$SERVER_PID"
sleep 1
start_server_on "$srv_sock" "$base" --read-only
wait "$fio_pid" || fail "fio through the agent failed across the server kill"
server_alive "$AGENT_PID" || fail "the agent died"
sleep 1.5   # the status file is rewritten every second

reconnects=$(agent_status_get t1 'j["server"]["reconnects"]')
retries=$(agent_status_get t1 'j["server"]["retries"]')
failovers=$(agent_status_get t1 'j["server"]["failovers"]')
log "agent: $reconnects reconnects, $retries re-sent requests, $failovers failovers"
((reconnects >= 1)) || fail "the agent did not reconnect"
assert_eq "failovers (one server)" "$failovers" 0
grep -q "reconnected to" "$AGENT_LOG" || fail "the reconnect was not logged"

rc=0
stop_server "$AGENT_PID" 15 || rc=$?
assert_eq "agent exit status" "$rc" 0
cmp "$base" "$E2E_TMP/base.pristine" || fail "the base file was modified"
