#!/usr/bin/env bash
# `vdstream pki init|issue|revoke|crl|list` and `target add --issue-cert`, checked with
# openssl and with gnutls peers (nbdkit as the TLS server, nbdinfo as the client):
# - init makes a CA (key 0600) and refuses to replace it (status 4) unless --force;
# - server, target and admin certificates verify against ca-cert.pem (`openssl verify`),
#   each carries its role URI (urn:vdstream:ROLE:NAME), a server its host names;
# - bad names are refused with the reason (status 2), a missing CA is status 3, a
#   certificate folder in the way status 4, and a refusal writes nothing;
# - revoke writes a CRL that `openssl crl -text` shows the serial in and that openssl and
#   nbdkit enforce, while other certificates keep working;
# - nbdkit --tls=require (and qemu-nbd --tls-creds) with the server folder serve nbdinfo
#   (nbds://127.0.0.1) and qemu-img (tls-creds-x509) with target and admin folders: the
#   certificates work with gnutls on both ends, and pass qemu's own checks;
# - `target add ID --issue-cert DIR` adds the record and issues the target's certificate.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
require openssl nbdkit nbdinfo qemu-img qemu-nbd
require_vdstream
e2e_init
store_init
V=$VDSTREAM_BIN
export VDSTREAM_CA=$E2E_TMP/ca
cd "$E2E_TMP"

# expect STATUS KIND PATTERN ARGS... — `vdstream ARGS` exits STATUS with PATTERN on stderr,
# and with --json prints the error object of KIND.
expect() {
    local want=$1 kind=$2 pattern=$3 rc=0; shift 3
    timeout 60 "$V" "$@" >out.txt 2>err.txt || rc=$?
    [[ $rc == "$want" ]] || fail "vdstream $*: status $rc, want $want: $(cat err.txt)"
    grep -Eq -- "$pattern" err.txt || fail "vdstream $*: stderr lacks /$pattern/: $(cat err.txt)"
    rc=0
    timeout 60 "$V" "$@" --json >out.json 2>err.txt || rc=$?
    [[ $rc == "$want" ]] || fail "vdstream $* --json: status $rc, want $want"
    assert_eq "vdstream ${*:1:3} --json: error kind" "$(json_get out.json 'j["error"]["kind"]')" "$kind"
}

# --- init --------------------------------------------------------------------------
expect 3 not_found "no certificate authority in .*vdstream pki init" pki issue target pc-07 --out t
"$V" pki init --farm lab >init.txt || fail "pki init: $(cat init.txt)"
grep -q 'created the CA "lab vdstream CA"' init.txt || fail "init says what it made: $(cat init.txt)"
assert_eq "CA key mode" "$(stat -c %a ca/ca-key.pem)" 600
openssl x509 -in ca/ca-cert.pem -noout -text >ca.txt
grep -q "CA:TRUE" ca.txt || fail "the CA certificate is a CA"
grep -q "Certificate Sign, CRL Sign" ca.txt || fail "the CA signs certificates and CRLs"
cp ca/ca-cert.pem ca-before.pem
expect 4 conflict "ca-cert.pem already exists.*--force" pki init --farm lab
cmp -s ca/ca-cert.pem ca-before.pem || fail "a refused init changed the CA"

# --- issue -------------------------------------------------------------------------
"$V" pki issue server store-a --out srv --dns store-a.lab.example --ip 10.9.8.7 >/dev/null
"$V" pki issue target pc-07 --out pc-07 >/dev/null
"$V" pki issue target pc-08 --out pc-08 >/dev/null
"$V" pki issue admin alice --out alice --json >alice.json
assert_eq "admin lifetime (days)" "$(json_get alice.json '(lambda t: (t(j["not_after"]) - t(j["issued"])).days)(lambda s: __import__("datetime").datetime.fromisoformat(s.replace("Z", "+00:00")))')" 90
for f in srv/server-cert.pem pc-07/client-cert.pem pc-08/client-cert.pem alice/client-cert.pem; do
    openssl verify -CAfile ca/ca-cert.pem "$f" >/dev/null || fail "openssl verify $f"
done
log "ok: openssl verifies every certificate against ca-cert.pem"
for f in srv/server-key.pem pc-07/client-key.pem alice/client-key.pem; do
    assert_eq "mode of $f" "$(stat -c %a "$f")" 600
done
san() { openssl x509 -in "$1" -noout -ext subjectAltName | tail -n +2 | tr -d ' '; }
assert_eq "pc-07's SAN" "$(san pc-07/client-cert.pem)" "URI:urn:vdstream:target:pc-07"
assert_eq "alice's SAN" "$(san alice/client-cert.pem)" "URI:urn:vdstream:admin:alice"
srv_san=$(san srv/server-cert.pem)
for want in URI:urn:vdstream:server:store-a DNS:localhost "IPAddress:127.0.0.1" DNS:store-a.lab.example "IPAddress:10.9.8.7"; do
    [[ ,$srv_san, == *,$want,* ]] || fail "the server certificate names $want: $srv_san"
done
assert_eq "pc-07's CN" "$(openssl x509 -in pc-07/client-cert.pem -noout -subject -nameopt RFC2253)" "subject=CN=pc-07"
openssl x509 -in srv/server-cert.pem -noout -ext extendedKeyUsage | grep -q "TLS Web Server Authentication, TLS Web Client Authentication" \
    || fail "a server certificate is good for both ends"
openssl x509 -in pc-07/client-cert.pem -noout -ext extendedKeyUsage | grep -q "Server" && fail "a target certificate is no server's"

# --- refusals ----------------------------------------------------------------------
expect 2 usage 'invalid target id "\.\./x": it contains a path separator' pki issue target ../x --out x
expect 2 usage "invalid value 'root'" pki issue root x --out x
expect 2 usage "not a DNS name" pki issue server s2 --out s2 --dns 'bad name'
expect 2 usage "not a server" pki issue target pc-09 --out pc-09 --dns x.example
expect 4 conflict "client-cert.pem already exists.*--force" pki issue target pc-07 --out pc-07
[[ ! -e x && ! -e s2 && ! -e pc-09 ]] || fail "a refused issue created a folder"
assert_eq "certificates on record after the refusals" "$("$V" pki list --json | json_get /dev/stdin 'len(j)')" 4

# --- a gnutls server and client on these certificates ---------------------------------
PEER_PORT=
PEER_PID=
# start_peer nbdkit|qemu-nbd — a gnutls NBD server on 127.0.0.1 with the server folder,
# requiring TLS and a client certificate from the CA; sets PEER_PID and PEER_PORT.
start_peer() {
    local kind=$1 try port cmd
    truncate -s 1M img
    for try in 1 2 3 4 5; do
        port=$((20000 + RANDOM % 20000))
        case $kind in
        nbdkit) cmd=(nbdkit -f --tls=require --tls-certificates="$E2E_TMP/srv" --tls-verify-peer -i 127.0.0.1 -p "$port" memory 1M) ;;
        qemu-nbd) cmd=(qemu-nbd --object "tls-creds-x509,id=tls0,endpoint=server,dir=$E2E_TMP/srv,verify-peer=on"
            --tls-creds tls0 -b 127.0.0.1 -p "$port" -f raw --persistent img) ;;
        esac
        "${cmd[@]}" >peer.log 2>&1 </dev/null &
        PEER_PID=$!
        sleep 0.3
        if kill -0 "$PEER_PID" 2>/dev/null; then
            track_pid "$PEER_PID"
            PEER_PORT=$port
            return 0
        fi
        log "$kind could not start on port $port (try $try): $(cat peer.log)"
    done
    fail "$kind did not start"
}
start_peer nbdkit
size_with() {
    local dir=$1 host=${2:-127.0.0.1} i
    for i in 1 2 3 4 5 6 7 8 9 10; do
        if out=$(timeout 20 nbdinfo --size "nbds://$host:$PEER_PORT/?tls-certificates=$E2E_TMP/$dir" 2>&1); then
            echo "$out"
            return 0
        fi
        # Not listening yet is the only reason to try again.
        grep -q "Connection refused" <<<"$out" || { echo "$out"; return 1; }
        sleep 0.2
    done
    echo "$out"
    return 1
}
assert_eq "nbdinfo with pc-07's certificate, nbds://127.0.0.1" "$(size_with pc-07)" 1048576
assert_eq "nbdinfo with alice's certificate, nbds://localhost" "$(size_with alice localhost)" 1048576
# qemu checks more of a certificate than libnbd (key usage, the CA's constraints).
qemu_size() {
    timeout 30 qemu-img info --output=json --object "tls-creds-x509,id=tls0,endpoint=client,dir=$E2E_TMP/$1" \
        --image-opts "driver=nbd,host=127.0.0.1,port=$PEER_PORT,tls-creds=tls0" | json_get /dev/stdin 'j["virtual-size"]'
}
assert_eq "qemu-img info with pc-07's certificate (tls-creds-x509)" "$(qemu_size pc-07)" 1048576
other=$(mktemp -d "$E2E_TMP/other-ca.XXXXXX")
VDSTREAM_CA=$other/ca "$V" pki init --farm other >/dev/null
VDSTREAM_CA=$other/ca "$V" pki issue target pc-07 --out "$other/pc-07" >/dev/null
cp ca/ca-cert.pem "$other/pc-07/ca-cert.pem"   # trusts the server, but is another CA's
if size_with "${other#"$E2E_TMP"/}/pc-07" >/dev/null 2>&1; then fail "nbdkit took a certificate of another CA"; fi
log "ok: a certificate of another CA is refused by nbdkit"

# --- revoke ------------------------------------------------------------------------
serial=$("$V" pki list --json | json_get /dev/stdin '[c["serial"] for c in j if c["identity"] == "target:pc-07"][0]')
"$V" pki revoke target:pc-07 --crl-out srv >revoke.txt || fail "pki revoke: $(cat revoke.txt)"
grep -q "revoked target:pc-07 (serial $serial)" revoke.txt || fail "revoke names what it revoked: $(cat revoke.txt)"
cmp -s ca/ca-crl.pem srv/ca-crl.pem || fail "--crl-out writes the CRL into the server folder"
openssl crl -in ca/ca-crl.pem -noout -text >crl.txt
grep -q "Serial Number: $serial" crl.txt || fail "openssl crl -text lists $serial: $(cat crl.txt)"
openssl crl -in ca/ca-crl.pem -noout -CAfile ca/ca-cert.pem 2>&1 | grep -q "verify OK" || fail "the CRL is signed by the CA"
log "ok: the CRL lists the revoked serial and is signed by the CA"
if openssl verify -crl_check -CAfile ca/ca-cert.pem -CRLfile ca/ca-crl.pem pc-07/client-cert.pem >/dev/null 2>&1; then
    fail "openssl accepts the revoked certificate"
fi
openssl verify -crl_check -CAfile ca/ca-cert.pem -CRLfile ca/ca-crl.pem pc-08/client-cert.pem >/dev/null || fail "pc-08 stays valid"
assert_eq "statuses" "$("$V" pki list --json | json_get /dev/stdin '",".join(c["identity"]+"="+c["status"] for c in j)')" \
    "server:store-a=valid,target:pc-07=revoked,target:pc-08=valid,admin:alice=valid"
expect 3 not_found "target:pc-07 has no unrevoked certificate" pki revoke target:pc-07
expect 4 conflict "was revoked on .* already" pki revoke "$serial"
expect 3 not_found "no certificate with serial 4ABC" pki revoke 4abc
expect 2 usage "not a certificate serial" pki revoke nonsense

# nbdkit reads ca-crl.pem at start: a restart applies the revocation.
stop_pid "$PEER_PID" 10
start_peer nbdkit
assert_eq "nbdinfo with pc-08's certificate after the revocation" "$(size_with pc-08)" 1048576
if size_with pc-07 >/dev/null 2>&1; then fail "nbdkit took the revoked certificate of pc-07"; fi
log "ok: nbdkit refuses the revoked certificate and serves the others"
stop_pid "$PEER_PID" 10
# qemu-nbd as the server (qemu's own checks of a server certificate), nbdinfo as the client.
start_peer qemu-nbd
assert_eq "qemu-nbd --tls-creds, nbdinfo with pc-08's certificate" "$(size_with pc-08)" 1048576
stop_pid "$PEER_PID" 10

# A certificate issued from now on comes with the CRL; `pki crl` signs a fresh one.
"$V" pki issue target pc-10 --out pc-10 >/dev/null
cmp -s ca/ca-crl.pem pc-10/ca-crl.pem || fail "a new certificate folder gets the CA's CRL"
assert_eq "fresh CRL number" "$("$V" pki crl --json | json_get /dev/stdin 'j["number"]')" 2

# --- target add --issue-cert ---------------------------------------------------------
vds vdisk create win11 --size 1M >/dev/null
vds target add pc-11 --vdisk win11 --cache device-disk --issue-cert pc-11 --json >add.json
assert_eq "the record" "$(json_get add.json 'j["id"]')" pc-11
assert_eq "its certificate" "$(json_get add.json 'j["certificate"]["identity"]')" target:pc-11
assert_eq "pc-11's SAN" "$(san pc-11/client-cert.pem)" "URI:urn:vdstream:target:pc-11"
openssl verify -CAfile ca/ca-cert.pem pc-11/client-cert.pem >/dev/null || fail "openssl verify pc-11"
# The certificate folder is checked before the record is added: a refusal adds nothing.
expect 4 conflict "not adding target pc-12.*client-cert.pem already exists" \
    target add pc-12 --vdisk win11 --cache device-disk --issue-cert pc-11 --store "$STORE"
expect 3 not_found "no target named \"pc-12\"" target show pc-12 --store "$STORE"
expect 3 not_found "no certificate authority in" \
    target add pc-12 --vdisk win11 --cache device-disk --issue-cert pc-12 --ca "$E2E_TMP/no-ca" --store "$STORE"

# --- init --force keeps the old CA aside ------------------------------------------------
"$V" pki init --farm lab --force >/dev/null
cmp -s ca/replaced-*/ca-cert.pem ca-before.pem || fail "init --force keeps the old CA in replaced-TIME/"
cmp -s ca/ca-cert.pem ca-before.pem && fail "init --force made no new CA"
assert_eq "certificates of the new CA" "$("$V" pki list --json | json_get /dev/stdin 'len(j)')" 0
log "PASS"
