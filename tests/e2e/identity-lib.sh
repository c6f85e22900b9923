# shellcheck shell=bash
# tests/e2e/identity-lib.sh — machines with a TPM (Debian's swtpm) and a store server that
# certifies them (`--identity-ca`), for test-identity-tpm.sh and bench/identity.sh (source
# after lib.sh, store-lib.sh and agent-lib.sh, after e2e_init and store_init).
#
#   identity_pki              a CA (VDSTREAM_CA), the server's certificate (ID_SRV_TLS) and a
#                             folder with the CA's certificate only (ID_CA_ONLY: what a
#                             machine verifies the server with before it has its own)
#   tpm_start NAME            starts (or restarts, on its state) machine NAME's TPM: swtpm on
#                             a unix data socket; sets TPM_NAME (the socket) and TPM_PID_NAME
#   tpm_stop NAME             stops it (its state stays: the next start is the same chip)
#   identity_server ARGS...   `vdstream server` on the store with NBD on a free port of
#                             127.0.0.1, the API over HTTPS, --identity-ca and ARGS; sets
#                             SERVER_PID, SERVER_LOG, ID_PORT, ID_API
#   identity_boot ID TPM ARGS...  a machine's attach with its TPM (`target attach ID --tpm`),
#                             in the background; sets BOOT_PID, BOOT_LOG, BOOT_CERTS

require swtpm

identity_pki() {
    export VDSTREAM_CA=$E2E_TMP/ca
    ID_SRV_TLS=$E2E_TMP/server-tls
    ID_CA_ONLY=$E2E_TMP/ca-only
    "$VDSTREAM_BIN" pki init --farm e2e >/dev/null || fail "pki init failed"
    "$VDSTREAM_BIN" pki issue server store-a --out "$ID_SRV_TLS" >/dev/null || fail "pki issue server failed"
    mkdir -p "$ID_CA_ONLY" && cp "$VDSTREAM_CA/ca-cert.pem" "$ID_CA_ONLY/"
}

tpm_start() {
    local name=$1 dir=$E2E_TMP/tpm-$1 i
    mkdir -p "$dir"
    rm -f "$dir/data.sock" "$dir/ctrl.sock"
    swtpm socket --tpm2 --tpmstate "dir=$dir" --server "type=unixio,path=$dir/data.sock" \
        --ctrl "type=unixio,path=$dir/ctrl.sock" --flags not-need-init,startup-clear \
        >"$dir/swtpm.log" 2>&1 </dev/null &
    track_pid $!
    printf -v "TPM_PID_$name" '%s' $!
    for ((i = 0; i < 100; i++)); do
        [[ -S $dir/data.sock ]] && break
        sleep 0.1
    done
    [[ -S $dir/data.sock ]] || fail "swtpm $name did not start: $(cat "$dir/swtpm.log")"
    printf -v "TPM_$name" '%s' "$dir/data.sock"
}

tpm_stop() {
    local v=TPM_PID_$1
    stop_pid "${!v}" 5
}

identity_server() {
    local i
    ID_PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    SERVER_LOG=$E2E_TMP/server.log
    "$VDSTREAM_BIN" server --store "$STORE" --listen "127.0.0.1:$ID_PORT" --http 127.0.0.1:0 \
        --tls-certificates "$ID_SRV_TLS" --identity-ca "$VDSTREAM_CA" "$@" >"$SERVER_LOG" 2>&1 </dev/null &
    SERVER_PID=$!
    E2E_PIDS+=("$SERVER_PID") E2E_SERVER_LOGS+=("$SERVER_LOG")
    for ((i = 0; i < READY_SECS * 10; i++)); do
        grep -Eq 'https://127\.0\.0\.1:[0-9]+' "$SERVER_LOG" && break
        kill -0 "$SERVER_PID" 2>/dev/null || fail "the server exited: $(cat "$SERVER_LOG")"
        sleep 0.1
    done
    ID_API=$(grep -Eo 'https://127\.0\.0\.1:[0-9]+' "$SERVER_LOG" | head -n1)
    [[ -n $ID_API ]] || fail "the server's API did not start"
}

ID_BOOTS=0
identity_boot() {
    local id=$1 tpm=$2
    shift 2
    agent_env
    BOOT_LOG=$E2E_TMP/boot-$id-$((++ID_BOOTS)).log
    BOOT_CERTS=$E2E_TMP/identity-$id-$ID_BOOTS
    VDSTREAM_TLS_CERTIFICATES=$ID_CA_ONLY "$VDSTREAM_BIN" target attach "$id" --server "$ID_API" --tpm "$tpm" \
        --identity-dir "$BOOT_CERTS" "$@" >"$BOOT_LOG" 2>&1 </dev/null &
    BOOT_PID=$!
    track_pid "$BOOT_PID"
}
