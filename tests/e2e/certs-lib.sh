# shellcheck shell=bash
# tests/e2e/certs-lib.sh — a throw-away CA made with openssl, and certificate folders in the
# layout qemu's tls-creds-x509, nbdkit, libnbd and vdstream read. The one copy for the
# end-to-end tests (through tls-lib.sh) and the benchmarks (bench/lib.sh). Needs openssl;
# uses the caller's `fail` when it has one.
#
# make_ca DIR [NAME]               a CA: DIR/ca-cert.pem, DIR/ca-key.pem
# issue CA_DIR OUT_DIR ROLE SAN [openssl ca date options...]
#     a certificate signed by CA_DIR into OUT_DIR: ROLE is server (server-cert.pem,
#     server-key.pem; keyUsage digitalSignature+keyEncipherment, which qemu needs) or client
#     (client-cert.pem, client-key.pem); ca-cert.pem is copied too. SAN as for openssl's
#     subjectAltName (e.g. "URI:urn:vdstream:target:pc-01" or "DNS:localhost,IP:127.0.0.1").
#     Extra arguments (e.g. -startdate 20200101000000Z -enddate 20200201000000Z) go to
#     `openssl ca`.
# issue_cn CA_DIR OUT_DIR CN [openssl ca date options...]
#     a client certificate as qemu's and nbdkit's documentation
#     make one: subject CN=CN, extendedKeyUsage clientAuth, signed by CA_DIR, no vdstream
#     role URI (no subjectAltName at all); into OUT_DIR with ca-cert.pem.
# make_pki DIR [TARGET]            DIR/ca, DIR/server (localhost and 127.0.0.1, + CA),
#     DIR/client (a target certificate urn:vdstream:target:TARGET, default pc-01, + CA).

certs_fail() {
    if declare -F fail >/dev/null; then fail "$@"; fi
    echo "certs-lib: $*" >&2
    exit 1
}

make_ca() {
    local dir=$1 name=${2:-vdstream test CA}
    mkdir -p "$dir"
    openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
        -keyout "$dir/ca-key.pem" -out "$dir/ca-cert.pem" -days 30 -subj "/CN=$name" \
        -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null \
        || certs_fail "openssl could not make the CA in $dir"
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
    local usage=digitalSignature
    # qemu (gnutls) refuses a server certificate whose keyUsage lacks keyEncipherment,
    # even for an ECDSA key.
    if [[ $role == server ]]; then eku=serverAuth usage=digitalSignature,keyEncipherment; else eku=clientAuth; fi
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
        -keyout "$out/$role-key.pem" -out "$out/$role.csr" -subj "/CN=$role ${san//[:,\/]/ }" 2>/dev/null \
        || certs_fail "openssl could not make a key for $out"
    printf '[ext]\nsubjectAltName = %s\nbasicConstraints = CA:FALSE\nkeyUsage = %s\nextendedKeyUsage = %s\n' \
        "$san" "$usage" "$eku" >"$out/$role.ext"
    openssl ca -batch -notext -config "$ca/ca.cnf" -cert "$ca/ca-cert.pem" -keyfile "$ca/ca-key.pem" \
        -in "$out/$role.csr" -out "$out/$role-cert.pem" -extfile "$out/$role.ext" -extensions ext "$@" 2>"$out/$role.log" \
        || certs_fail "openssl ca could not sign $out/$role-cert.pem: $(cat "$out/$role.log")"
    rm -f "$out/$role.csr"
}

issue_cn() {
    local ca=$1 out=$2 cn=$3
    shift 3
    mkdir -p "$out"
    cp "$ca/ca-cert.pem" "$out/ca-cert.pem"
    openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes \
        -keyout "$out/client-key.pem" -out "$out/client.csr" -subj "/CN=$cn" 2>/dev/null \
        || certs_fail "openssl could not make a key for $out"
    printf '[ext]\nbasicConstraints = CA:FALSE\nkeyUsage = digitalSignature\nextendedKeyUsage = clientAuth\n' >"$out/client.ext"
    openssl ca -batch -notext -config "$ca/ca.cnf" -cert "$ca/ca-cert.pem" -keyfile "$ca/ca-key.pem" \
        -in "$out/client.csr" -out "$out/client-cert.pem" -extfile "$out/client.ext" -extensions ext "$@" 2>"$out/client.log" \
        || certs_fail "openssl ca could not sign $out/client-cert.pem: $(cat "$out/client.log")"
    rm -f "$out/client.csr"
}

make_pki() {
    local dir=$1 target=${2:-pc-01}
    make_ca "$dir/ca"
    issue "$dir/ca" "$dir/server" server "DNS:localhost,IP:127.0.0.1"
    issue "$dir/ca" "$dir/client" client "URI:urn:vdstream:target:$target"
}
