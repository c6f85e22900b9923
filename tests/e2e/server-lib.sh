# shellcheck shell=bash
# tests/e2e/server-lib.sh — helpers for the test-server-*.sh tests (source after lib.sh
# and store-lib.sh):
#   start_store_server [ARGS...]        `vdstream server --store $STORE` on a fresh unix
#                                       socket; waits (bounded) until it lists its exports.
#                                       Sets SERVER_PID, SERVER_LOG, SOCK.
#   start_store_server_on SOCK [ARGS...] the same on a given socket (to restart a server)
#   xuri EXPORT [SOCK]                   the URI of EXPORT on SOCK (default $SOCK)
#   refusal EXPORT [SOCK]                NBD_OPT_GO EXPORT; prints "REPLY-TYPE MESSAGE" of
#                                        the refusal, or "accepted"

start_store_server() {
    start_store_server_on "$E2E_TMP/srv${#E2E_SERVER_PIDS[@]}.sock" "$@"
}

start_store_server_on() {
    local sock=$1 n=${#E2E_SERVER_PIDS[@]} deadline=$((SECONDS + READY_SECS)) rc
    shift
    SERVER_LOG=$E2E_TMP/server$n.log
    log "starting: vdstream server --store $STORE --socket $sock $*"
    "$VDSTREAM_BIN" server --store "$STORE" --socket "$sock" "$@" >"$SERVER_LOG" 2>&1 </dev/null &
    SERVER_PID=$!
    E2E_PIDS+=("$SERVER_PID")
    E2E_SERVER_PIDS+=("$SERVER_PID")
    E2E_SERVER_LOGS+=("$SERVER_LOG")
    SOCK=$sock
    while ((SECONDS < deadline)); do
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then
            wait "$SERVER_PID" 2>/dev/null && rc=0 || rc=$?
            fail "the server exited (status $rc) before accepting connections"
        fi
        if [[ -S $sock ]] && timeout 5 nbdinfo --list "nbd+unix:///?socket=$sock" >/dev/null 2>&1; then
            return 0
        fi
        sleep 0.1
    done
    fail "the server did not list its exports on $sock within ${READY_SECS}s"
}

xuri() { printf 'nbd+unix:///%s?socket=%s' "$1" "${2:-$SOCK}"; }

refusal() {
    PYTHONPATH=$E2E_DIR "$PY" - "${2:-$SOCK}" "$1" <<'PYEOF'
import sys
from rawnbd import *
s = connect(sys.argv[1])
try:
    handshake(s, sys.argv[2].encode())
    print("accepted")
except AssertionError as e:
    print(e)
PYEOF
}

# golden_vdisk NAME MIB — a vDisk of MIB MiB of random bytes, with a production version.
golden_vdisk() {
    head -c $(($2 << 20)) /dev/urandom >"$E2E_TMP/$1.img"
    vds vdisk import "$1" "$E2E_TMP/$1.img" >/dev/null
    rm -f "$E2E_TMP/$1.img"
    new_patched_version "$1" production 0 64k 0x5e >/dev/null
}
