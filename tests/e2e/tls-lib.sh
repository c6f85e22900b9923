# shellcheck shell=bash
# tests/e2e/tls-lib.sh — certificates made with openssl for the TLS tests, and a server
# started with TLS (source it after lib.sh, after e2e_init).
#
# make_ca DIR [NAME]               a CA: DIR/ca-cert.pem, DIR/ca-key.pem
# issue CA_DIR OUT_DIR ROLE SAN [openssl ca date options...]
#     a certificate signed by CA_DIR into OUT_DIR in qemu's tls-creds-x509 layout: ROLE is
#     server (server-cert.pem/server-key.pem) or client (client-cert.pem/client-key.pem);
#     ca-cert.pem is copied too. SAN as for openssl's subjectAltName (e.g.
#     "URI:urn:vdstream:target:pc-01" or "DNS:localhost,IP:127.0.0.1"). Extra arguments
#     (e.g. -startdate 20200101000000Z -enddate 20200201000000Z) go to `openssl ca`.
# make_pki DIR                     DIR/server (server + CA), DIR/client (a target
#     certificate urn:vdstream:target:pc-01 + CA), DIR/ca.
# free_port                        a free TCP port on 127.0.0.1
# start_tls_server ARGS...         `vdstream serve-image ARGS` on a fresh unix socket and a
#     fresh port of 127.0.0.1, waited for with an nbds+unix:// nbdinfo using $TLS_CLIENT_DIR.
#     Sets SERVER_PID, SOCK, PORT, SERVER_LOG, TLS_URI_UNIX, TLS_URI_TCP (export "vdstream").

require openssl

make_ca() {
    local dir=$1 name=${2:-vdstream test CA}
    mkdir -p "$dir"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
        -keyout "$dir/ca-key.pem" -out "$dir/ca-cert.pem" -days 30 -subj "/CN=$name" \
        -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null \
        || fail "openssl could not make the CA in $dir"
    touch "$dir/index.txt"
    [[ -e $dir/serial ]] || echo 1000 >"$dir/serial"
    [[ -e $dir/crlnumber ]] || echo 01 >"$dir/crlnumber"
    cat >"$dir/ca.cnf" <<EOF
[ca]
default_ca = ca_default
[ca_default]
database = $dir/index.txt
new_certs_dir = $dir
serial = $dir/serial
default_md = sha256
default_days = 30
default_crl_days = 30
policy = policy_any
copy_extensions = none
unique_subject = no
crlnumber = $dir/crlnumber
crl_extensions = crl_ext
[crl_ext]
authorityKeyIdentifier = keyid:always
[policy_any]
commonName = supplied
EOF
}

issue() {
    local ca=$1 out=$2 role=$3 san=$4 eku
    shift 4
    mkdir -p "$out"
    cp "$ca/ca-cert.pem" "$out/ca-cert.pem"
    if [[ $role == server ]]; then eku=serverAuth; else eku=clientAuth; fi
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
        -keyout "$out/$role-key.pem" -out "$out/$role.csr" -subj "/CN=$role ${san//[:,\/]/ }" 2>/dev/null \
        || fail "openssl could not make a key for $out"
    printf '[ext]\nsubjectAltName = %s\nbasicConstraints = CA:FALSE\nkeyUsage = digitalSignature\nextendedKeyUsage = %s\n' \
        "$san" "$eku" >"$out/$role.ext"
    openssl ca -batch -notext -config "$ca/ca.cnf" -cert "$ca/ca-cert.pem" -keyfile "$ca/ca-key.pem" \
        -in "$out/$role.csr" -out "$out/$role-cert.pem" -extfile "$out/$role.ext" -extensions ext "$@" 2>"$out/$role.log" \
        || fail "openssl ca could not sign $out/$role-cert.pem: $(cat "$out/$role.log")"
    rm -f "$out/$role.csr"
}

make_pki() {
    local dir=$1
    make_ca "$dir/ca"
    issue "$dir/ca" "$dir/server" server "DNS:localhost,IP:127.0.0.1"
    issue "$dir/ca" "$dir/client" client "URI:urn:vdstream:target:pc-01"
}

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
