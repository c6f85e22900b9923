#!/usr/bin/env bash
# A target that boots while its servers are down (issue 20, "bad input: a server that is
# down at boot time"): the attach waits, printing on stderr (the console) one line a round
# that names what it waits for, and attaches once a server starts; with --retry-for it
# gives up with exit status 6. Both for store servers (--server http://) and NBD URIs.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=server-lib.sh
source "$E2E_DIR/server-lib.sh"
# shellcheck source=agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
require nbdinfo
require_vdstream
e2e_init
store_init
agent_env

golden_vdisk w 16
port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
url=http://127.0.0.1:$port

# wait_for_line FILE PATTERN COUNT — bounded wait until FILE holds COUNT lines matching PATTERN.
wait_for_line() {
    local i
    for ((i = 0; i < READY_SECS * 10; i++)); do
        (($(grep -c -- "$2" "$1" 2>/dev/null || true) >= $3)) && return 0
        sleep 0.1
    done
    fail "no $3 line(s) matching '$2' in $1 within ${READY_SECS}s: $(cat "$1")"
}

# 1. Store server down at boot: the attach waits and says so, then attaches.
log "attach before the server: $url"
"$VDSTREAM_BIN" target attach lab1 --server "$url" --vdisk w --cache device-ram --ram 8M >"$E2E_TMP/lab1.out" 2>"$E2E_TMP/lab1.err" </dev/null &
AGENT_PID=$!
E2E_PIDS+=("$AGENT_PID")
wait_for_line "$E2E_TMP/lab1.err" "vdstream: target lab1: waiting for store server $url (connection refused); retrying in [0-9.]* s" 2
kill -0 "$AGENT_PID" 2>/dev/null || fail "the attach gave up while the server was down: $(cat "$E2E_TMP/lab1.err")"
start_store_server --name a --http "127.0.0.1:$port"
wait_ready "$AGENT_PID" "nbd+unix:///?socket=$VDSTREAM_RUN_DIR/lab1.sock"
assert_eq "size through the agent" "$(nbdinfo --size "nbd+unix:///?socket=$VDSTREAM_RUN_DIR/lab1.sock")" $((16 << 20))
grep -q "waiting for store server" "$E2E_TMP/lab1.out" && fail "the waiting lines went to stdout, not to the console's stderr"
stop_server "$AGENT_PID" || fail "the agent did not stop cleanly"

# 2. --retry-for bounds the wait: exit status 6 (unavailable), naming the server.
dead=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
rc=0
started=$SECONDS
run_bounded 30 "$VDSTREAM_BIN" target attach lab2 --server "http://127.0.0.1:$dead" --vdisk w --cache device-ram --ram 8M --retry-for 3s >"$E2E_TMP/lab2.out" 2>&1 </dev/null || rc=$?
cat "$E2E_TMP/lab2.out" >&2
assert_eq "exit status after --retry-for" "$rc" 6
((SECONDS - started >= 2)) || fail "--retry-for 3s gave up after $((SECONDS - started))s"
grep -q "waiting for store server http://127.0.0.1:$dead" "$E2E_TMP/lab2.out" || fail "no waiting line before giving up"
grep -q "no store server answered for target lab2" "$E2E_TMP/lab2.out" || fail "the error does not say no server answered"

# 3. An NBD server down at attach: the same, one line a round naming the URI.
late=$E2E_TMP/late.sock
uri="nbd+unix:///vdisk/w?socket=$late"
"$VDSTREAM_BIN" target attach lab3 --server "$uri" --cache device-ram --ram 8M >"$E2E_TMP/lab3.out" 2>"$E2E_TMP/lab3.err" </dev/null &
AGENT_PID=$!
E2E_PIDS+=("$AGENT_PID")
wait_for_line "$E2E_TMP/lab3.err" "target lab3: waiting for a server: $uri (.*); retrying in [0-9.]* s" 2
start_store_server_on "$late"
wait_ready "$AGENT_PID" "nbd+unix:///?socket=$VDSTREAM_RUN_DIR/lab3.sock"
assert_eq "size through the agent" "$(nbdinfo --size "nbd+unix:///?socket=$VDSTREAM_RUN_DIR/lab3.sock")" $((16 << 20))
stop_server "$AGENT_PID" || fail "the agent did not stop cleanly"
log "PASS"
