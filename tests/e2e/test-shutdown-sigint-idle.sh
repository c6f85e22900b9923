#!/usr/bin/env bash
# SIGINT (Ctrl-C) with one idle client connected and with none: the server exits 0
# within 10 s both times, and the idle client sees the connection close.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdsh
require_python_nbd
e2e_init

start_server --memory 16M
rc=0
SIGNAL=INT stop_server "$SERVER_PID" 10 || rc=$?
assert_eq "exit status after SIGINT, no clients" "$rc" 0

start_server --memory 16M
ready=$E2E_TMP/idle.ready
nbdsh -u "$URI" -c "
import time
h.pwrite(b'a' * 4096, 0)
open('$ready', 'w').write('1')
deadline = time.time() + 30
while time.time() < deadline:
    try:
        h.pread(4096, 0)
    except nbd.Error:
        print('client: connection closed by server')
        raise SystemExit(0)
    time.sleep(0.5)
raise SystemExit('client: server never closed the connection')
" >"$E2E_TMP/client.out" 2>&1 &
client=$!
track_pid "$client"
for _ in $(seq 100); do [[ -s $ready ]] && break; sleep 0.1; done
[[ -s $ready ]] || { cat "$E2E_TMP/client.out" >&2; fail "idle client did not connect"; }
rc=0
SIGNAL=INT stop_server "$SERVER_PID" 10 || rc=$?
assert_eq "exit status after SIGINT, one idle client" "$rc" 0
crc=0
timeout 40 tail --pid="$client" -f /dev/null || true
wait "$client" || crc=$?
cat "$E2E_TMP/client.out" >&2
assert_eq "idle client saw the close" "$crc" 0
