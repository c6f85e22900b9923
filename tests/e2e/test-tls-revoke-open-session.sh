#!/usr/bin/env bash
# Revocation reaches sessions already open: a target reads through an open TLS session;
# its certificate is then revoked (openssl ca -revoke, a new ca-crl.pem in the server's
# certificate directory). The server closes that session within the stated bound (the CRL
# is checked every 5 s: closed within 5 s, allowed 8 s here), logs a line naming the
# target, and refuses the certificate on the next connection; another target's session
# goes on.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdinfo
require_python_nbd
require_vdstream
e2e_init
# shellcheck source=tls-lib.sh
source "$E2E_DIR/tls-lib.sh"

make_pki "$E2E_TMP/pki"
issue "$E2E_TMP/pki/ca" "$E2E_TMP/pki/other" client "URI:urn:vdstream:target:pc-02"
TLS_CLIENT_DIR=$E2E_TMP/pki/client
start_tls_server --memory 16M --tls require --tls-certificates "$E2E_TMP/pki/server"

# reader DIR OUT: reads 4 KiB every 0.1 s for up to 20 s; writes to OUT the seconds since
# the file $E2E_TMP/revoked appeared when a read failed ("never" if none failed).
reader() {
    "$PY" - "$SOCK" "$1" "$E2E_TMP/revoked" >"$2" 2>&1 <<'PYEOF' &
import nbd, os, sys, time
sock, certs, mark = sys.argv[1:4]
h = nbd.NBD()
h.set_tls(nbd.TLS_REQUIRE)
h.set_tls_certificates(certs)
h.connect_unix(sock)
assert h.get_tls_negotiated()
print("connected", flush=True)
deadline = time.monotonic() + 20
while time.monotonic() < deadline:
    try:
        h.pread(4096, 0)
    except nbd.Error as e:
        since = time.time() - os.stat(mark).st_mtime if os.path.exists(mark) else -1
        print(f"failed {since:.1f} {e}")
        sys.exit(0)
    time.sleep(0.1)
print("never")
PYEOF
    track_pid $!
}
reader "$TLS_CLIENT_DIR" "$E2E_TMP/a.out"; pid_a=$!
reader "$E2E_TMP/pki/other" "$E2E_TMP/b.out"; pid_b=$!
for _ in $(seq 100); do
    grep -q connected "$E2E_TMP/a.out" 2>/dev/null && grep -q connected "$E2E_TMP/b.out" 2>/dev/null && break
    sleep 0.1
done
grep -q connected "$E2E_TMP/a.out" || fail "target pc-01 could not connect: $(cat "$E2E_TMP/a.out")"
sleep 1

ca=$E2E_TMP/pki/ca
openssl ca -config "$ca/ca.cnf" -cert "$ca/ca-cert.pem" -keyfile "$ca/ca-key.pem" \
    -revoke "$TLS_CLIENT_DIR/client-cert.pem" 2>/dev/null || fail "openssl ca -revoke failed"
openssl ca -config "$ca/ca.cnf" -cert "$ca/ca-cert.pem" -keyfile "$ca/ca-key.pem" \
    -gencrl -out "$E2E_TMP/ca-crl.pem" 2>/dev/null || fail "openssl ca -gencrl failed"
mv "$E2E_TMP/ca-crl.pem" "$E2E_TMP/pki/server/ca-crl.pem"
touch "$E2E_TMP/revoked"
log "revoked target pc-01's certificate"

wait "$pid_a" || true
read -r what secs _ <"$E2E_TMP/a.out" < <(tail -1 "$E2E_TMP/a.out")
[[ $what == failed ]] || fail "the revoked target's session stayed open: $(cat "$E2E_TMP/a.out")"
"$PY" -c "import sys; s=float(sys.argv[1]); sys.exit(0 if 0 <= s <= 8 else 1)" "$secs" \
    || fail "the revoked session was closed after ${secs}s, not within 8 s"
log "ok: the revoked target's session was closed ${secs}s after the revocation"
grep -q "target:pc-01.*revoked" "$SERVER_LOG" || fail "no log line names the revoked target: $(tail "$SERVER_LOG")"

rc=0
out=$(run_bounded 20 nbdinfo --size "$TLS_URI_UNIX" 2>&1) || rc=$?
((rc != 0)) || fail "the revoked certificate connected again"
log "ok: the revoked certificate is refused on the next connection"

wait "$pid_b" || true
assert_eq "the other target's session" "$(tail -1 "$E2E_TMP/b.out")" never
