# shellcheck shell=bash
# tests/e2e/tls-lib.sh — certificates made with openssl for the TLS tests, and a server
# started with TLS (source it after lib.sh, after e2e_init).
#
# make_ca, issue, make_pki         see certs-lib.sh
# free_port                        a free TCP port on 127.0.0.1
# start_tls_server ARGS...         `vdstream serve-image ARGS` on a fresh unix socket and a
#     fresh port of 127.0.0.1, waited for with an nbds+unix:// nbdinfo using $TLS_CLIENT_DIR.
#     Sets SERVER_PID, SOCK, PORT, SERVER_LOG, TLS_URI_UNIX, TLS_URI_TCP (export "vdstream").

require openssl

# shellcheck source=certs-lib.sh
source "$E2E_DIR/certs-lib.sh"

free_port() {
    "$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}

start_tls_server() {
    local n=${#E2E_SERVER_PIDS[@]} deadline
    SOCK=$E2E_TMP/server$n.sock
    PORT=$(free_port)
    SERVER_LOG=$E2E_TMP/server$n.log
    TLS_URI_UNIX="nbds+unix:///vdstream?socket=$SOCK&tls-certificates=$TLS_CLIENT_DIR"
    TLS_URI_TCP="nbds://127.0.0.1:$PORT/vdstream?tls-certificates=$TLS_CLIENT_DIR"
    log "starting: $VDSTREAM_BIN serve-image --socket $SOCK --listen 127.0.0.1:$PORT $*"
    RUST_LOG=${RUST_LOG:-info} "$VDSTREAM_BIN" serve-image --socket "$SOCK" --listen "127.0.0.1:$PORT" "$@" >"$SERVER_LOG" 2>&1 </dev/null &
    SERVER_PID=$!
    E2E_PIDS+=("$SERVER_PID")
    E2E_SERVER_PIDS+=("$SERVER_PID")
    E2E_SERVER_LOGS+=("$SERVER_LOG")
    deadline=$((SECONDS + READY_SECS))
    while ((SECONDS < deadline)); do
        server_alive "$SERVER_PID" || fail "server exited before accepting connections: $(cat "$SERVER_LOG")"
        if [[ -S $SOCK ]] && timeout 5 nbdinfo --size "$TLS_URI_UNIX" >/dev/null 2>&1; then
            return 0
        fi
        sleep 0.1
    done
    fail "server did not accept a TLS handshake on $SOCK within ${READY_SECS}s"
}
