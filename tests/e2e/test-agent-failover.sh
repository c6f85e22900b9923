#!/usr/bin/env bash
# Two serve-image servers of the same base file; the agent lists both. In the middle of an
# fio run (crc32c verify) the server in use is killed with SIGKILL and not restarted: the
# agent moves to the other one (one failover, logged), fio finishes with zero errors, and
# `target status` names the second server as the one in use, connected.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
# shellcheck source=fio-verify.sh
source "$E2E_DIR/fio-verify.sh"
require fio nbdinfo
require_vdstream
e2e_init

base=$E2E_TMP/base.img
head -c $((128 << 20)) /dev/urandom >"$base"

start_server "$base" --read-only
pid_a=$SERVER_PID sock_a=$SOCK
start_server "$base" --read-only
sock_b=$SOCK
start_agent t2 --server "nbd+unix:///?socket=$sock_a" --server "nbd+unix:///?socket=$sock_b" \
    --cache ram-overflow --ram 16M
sleep 1.2
assert_eq "server in use at attach" "$(agent_status_get t2 'j["server"]["endpoint"]')" "nbd+unix:///?socket=$sock_a"

run_fio_verify failover --rw=randrw --rwmixwrite=40 --bs=4k --size=96m --iodepth=16 \
    --rate_iops=4000 --number_ios=24000 &
fio_pid=$!
sleep 2
log "SIGKILL to the server in use (pid $pid_a)"
kill -KILL "$pid_a"
wait "$fio_pid" || fail "fio through the agent failed across the failover"
server_alive "$AGENT_PID" || fail "the agent died"
sleep 1.5
assert_eq "server in use after the kill" "$(agent_status_get t2 'j["server"]["endpoint"]')" "nbd+unix:///?socket=$sock_b"
assert_eq "connected" "$(agent_status_get t2 'j["server"]["connected"]')" True
assert_eq "failovers" "$(agent_status_get t2 'j["server"]["failovers"]')" 1
grep -q "failover from" "$AGENT_LOG" || fail "the failover was not logged"
rc=0
stop_server "$AGENT_PID" 15 || rc=$?
assert_eq "agent exit status" "$rc" 0
