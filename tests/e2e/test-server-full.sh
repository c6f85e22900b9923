#!/usr/bin/env bash
# A server out of room says so, and agents go elsewhere:
# - at start the soft open-files limit is raised to the hard one, and the log says so;
# - a connection costs 3 descriptors (socket, layer file, its lock) for a one-layer vDisk;
# - past --max-connections a client is told "server full: N connections
#   (--max-connections N)" (NBD_REP_ERR_SHUTDOWN), and the server logs the refusal with
#   the client and the export; an agent listing a second server attaches there;
# - a server that runs out of descriptors while opening (a low hard limit, a high cap)
#   answers "server full: out of file descriptors", never "no such export"; an agent that
#   meets it keeps trying, and attaches once connections close.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=server-lib.sh
source "$E2E_DIR/server-lib.sh"
# shellcheck source=agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
require prlimit nbdinfo
require_vdstream
e2e_init
store_init

vds vdisk create d --size 8M >/dev/null
real_bin=$VDSTREAM_BIN
# with_limit SOFT:HARD — later servers run under that open-files limit.
with_limit() {
    printf '#!/bin/sh\nexec prlimit --nofile=%s -- "%s" "$@"\n' "$1" "$real_bin" >"$E2E_TMP/vds-limited"
    chmod +x "$E2E_TMP/vds-limited"
    VDSTREAM_BIN=$E2E_TMP/vds-limited
}
fds() { find "/proc/$1/fd" -mindepth 1 -maxdepth 1 | wc -l; }
# hold SOCK N NAME — hold up to N connections to vdisk/d; results in $E2E_TMP/NAME.
hold() {
    "$PY" "$E2E_DIR/hold_conns.py" "$1" vdisk/d "$2" "$E2E_TMP/$3" "$E2E_TMP/$3.stop" &
    track_pid $!
    local i
    for ((i = 0; i < 200; i++)); do [[ -e $E2E_TMP/$3 ]] && return 0; sleep 0.1; done
    fail "the connections to $1 did not settle within 20 s"
}

# 1. The soft limit is raised to the hard one; the cap refuses the excess by name.
with_limit 256:2048
start_store_server --max-connections 3
full_pid=$SERVER_PID full_sock=$SOCK full_log=$SERVER_LOG
grep -q "open-files limit raised from 256 to 2048" "$full_log" || fail "the server did not log raising its open-files limit: $(head -3 "$full_log")"
soft=$(awk '/Max open files/ {print $4}' "/proc/$full_pid/limits")
assert_eq "soft open-files limit of the server" "$soft" 2048
log "ok: soft open-files limit raised from 256 to 2048, and logged"

before=$(fds "$full_pid")
hold "$full_sock" 3 held
assert_eq "3 connections under --max-connections 3" "$(grep -c accepted "$E2E_TMP/held")" 3
sleep 0.3
per=$(( ($(fds "$full_pid") - before) / 3 ))
((per <= 3)) || fail "a connection to a one-layer vDisk costs $per descriptors (want at most 3)"
log "ok: $per descriptors per connection"

got=$(refusal vdisk/d "$full_sock")
[[ $got == *"0x80000007"* && $got == *"server full: 3 connections (--max-connections 3)"* ]] ||
    fail "the 4th connection: want NBD_REP_ERR_SHUTDOWN 'server full: 3 connections (--max-connections 3)', got: $got"
grep -q 'open refused (server full): client unix, export "vdisk/d"' "$full_log" || fail "the refusal is not in the server log"
log "ok: the 4th connection is told: $got"

# 2. An agent listing the full server first attaches to the second.
with_limit 1024:1024
start_store_server
ok_sock=$SOCK
start_agent t1 --server "$(xuri vdisk/d "$full_sock")" --server "$(xuri vdisk/d "$ok_sock")" --cache ram-overflow --ram 16M
assert_eq "server in use" "$(agent_status_get t1 'j["server"]["endpoint"]')" "$(xuri vdisk/d "$ok_sock")"
grep -q "server full" "$AGENT_LOG" || fail "the agent did not log why it skipped the first server"
stop_server "$AGENT_PID" 15 || fail "the agent did not stop cleanly"
log "ok: the agent skipped the full server for the second one"
touch "$E2E_TMP/held.stop"

# 3. Out of descriptors while opening: "server full", never "no such export"; an agent
# meeting it waits for room instead of giving up.
with_limit 40:40
start_store_server --max-connections 1000
tight_pid=$SERVER_PID tight_sock=$SOCK tight_log=$SERVER_LOG
hold "$tight_sock" 100 tight
last=$(tail -n 1 "$E2E_TMP/tight")
log "filled at $(grep -c accepted "$E2E_TMP/tight") connections; then: $last"
[[ $last == *"0x80000007"* && $last == *"server full: out of file descriptors"* ]] ||
    fail "a server out of descriptors must answer 'server full', got: $last"
grep -q 'open refused (server full): client unix, export "vdisk/d"' "$tight_log" || fail "the refusal is not in the server log"
if grep -qi "no vdisk named\|unknown export" "$tight_log"; then fail "the server called an fd shortage an unknown export"; fi

start_agent_bg() {
    agent_env
    AGENT_SOCK=$VDSTREAM_RUN_DIR/t2.sock AGENT_LOG=$E2E_TMP/agent-t2.log
    "$real_bin" target attach t2 --server "$(xuri vdisk/d "$tight_sock")" --cache ram-overflow --ram 16M >"$AGENT_LOG" 2>&1 </dev/null &
    AGENT_PID=$!
    track_pid "$AGENT_PID"
}
start_agent_bg
for ((i = 0; i < 100; i++)); do grep -q "server full" "$AGENT_LOG" && break; sleep 0.1; done
grep -q "server full" "$AGENT_LOG" || fail "the agent did not meet the full server: $(cat "$AGENT_LOG")"
sleep 1
kill -0 "$AGENT_PID" 2>/dev/null || fail "the agent gave up on a full server: $(tail -3 "$AGENT_LOG")"
touch "$E2E_TMP/tight.stop"
wait_ready "$AGENT_PID" "nbd+unix:///?socket=$AGENT_SOCK"
assert_eq "agent connected" "$(agent_status_get t2 'j["server"]["connected"]')" True
stop_server "$AGENT_PID" 15 || fail "the agent did not stop cleanly"
server_alive "$tight_pid" || fail "the server died of the descriptor shortage"
log "ok: out of descriptors is 'server full'; the agent waited and attached once there was room"
