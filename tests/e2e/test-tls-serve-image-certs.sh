#!/usr/bin/env bash
# `serve-image --tls require` with the client certificates qemu's and nbdkit's
# documentation make (subject CN=t1, extendedKeyUsage clientAuth, signed by the CA, no
# vdstream role URI), driven by nbdinfo (libnbd, gnutls) with its default settings:
#  1. A certificate the CA signed is enough, as for nbdkit and qemu-nbd: served on the unix
#     socket and on TCP. A client without one is refused with NBD_REP_ERR_POLICY, and the
#     refusal says what to do.
#  2. --tls-allow-name t1 narrows it: t1 is served; t2 and a vdstream role certificate are
#     refused with NBD_REP_ERR_POLICY naming the certificate and the flag, and logged.
#  3. A certificate that fails verification (signed by another CA; expired) is refused at
#     the TLS handshake even with --anonymous all (never served as anonymous), the log says
#     why, and the failures count against the address (--handshake-penalty): past them its
#     connections are closed at accept.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdinfo
require_vdstream
e2e_init
# shellcheck source=tls-lib.sh
source "$E2E_DIR/tls-lib.sh"

P=$E2E_TMP/pki
make_pki "$P"
issue_cn "$P/ca" "$P/t1" t1
issue_cn "$P/ca" "$P/t2" t2
issue_cn "$P/ca" "$P/expired" t1 -startdate 20200101000000Z -enddate 20200201000000Z
make_ca "$P/other" "another CA"
issue_cn "$P/other" "$P/stranger" t1
cp "$P/ca/ca-cert.pem" "$P/stranger/ca-cert.pem" # it trusts the server; its own certificate is another CA's
mkdir -p "$P/nocert"
cp "$P/ca/ca-cert.pem" "$P/nocert/ca-cert.pem"
TLS_CLIENT_DIR=$P/client
SIZE=$((16 << 20))

# size_with DIR [tcp] — nbdinfo --size with DIR's certificates; prints the size, or
# "refused: " and nbdinfo's last line.
size_with() {
    local uri="nbds+unix:///?socket=$SOCK&tls-certificates=$1" out rc=0
    [[ ${2:-} == tcp ]] && uri="nbds://127.0.0.1:$PORT/?tls-certificates=$1"
    out=$(run_bounded 20 nbdinfo --size "$uri" 2>&1) || rc=$?
    if ((rc == 0)); then echo "$out"; else echo "refused: $(tail -n1 <<<"$out")"; fi
}

# reply_with DIR — STARTTLS with DIR's client certificate (python's ssl sends it whatever
# CA the server names), then NBD_OPT_GO: prints "served", "REPLY-TYPE MESSAGE" of the
# refusal, or "tls-refused: WHY".
reply_with() {
    "$PY" - "$SOCK" "$1" <<'PYEOF'
import os, socket, ssl, struct, sys
sock_path, certs = sys.argv[1:3]
def recv_exact(s, n):
    b = b""
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c:
            raise OSError("the server closed the connection")
        b += c
    return b
s = socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect(sock_path)
recv_exact(s, 18); s.sendall(struct.pack(">I", 3))
s.sendall(struct.pack(">QII", 0x49484156454F5054, 5, 0)); recv_exact(s, 20)
ctx = ssl.create_default_context(cafile=f"{certs}/ca-cert.pem")
if os.path.exists(f"{certs}/client-cert.pem"):
    ctx.load_cert_chain(f"{certs}/client-cert.pem", f"{certs}/client-key.pem")
try:
    t = ctx.wrap_socket(s, server_hostname="localhost")
    t.sendall(struct.pack(">QII", 0x49484156454F5054, 7, 6) + struct.pack(">I", 0) + b"\0\0")
    while True:
        magic, opt, rtype, length = struct.unpack(">QIII", recv_exact(t, 20))
        msg = recv_exact(t, length)
        if rtype & 0x80000000:
            print(hex(rtype), msg.decode(errors="replace"))
            break
        if rtype == 1:
            print("served")
            break
except (ssl.SSLError, OSError) as e:
    print(f"tls-refused: {e}")
PYEOF
}
POLICY=0x80000002

# 1. A certificate the CA signed is enough.
start_tls_server --memory 16M --tls require --tls-certificates "$P/server"
assert_eq "nbdinfo with a CN=t1 certificate (unix)" "$(size_with "$P/t1")" $SIZE
assert_eq "nbdinfo with a CN=t1 certificate (TCP)" "$(size_with "$P/t1" tcp)" $SIZE
assert_eq "nbdinfo with a vdstream role certificate" "$(size_with "$P/client")" $SIZE
out=$(size_with "$P/nocert")
[[ $out == refused:* && $out == *"policy"* ]] || fail "a client without a certificate: $out"
out=$(reply_with "$P/nocert")
[[ $out == "$POLICY "* && $out == *"client certificate"* ]] || fail "the refusal of a client without a certificate: $out"
grep -q "NBD client unix: .* certificate:t1" "$SERVER_LOG" || fail "the log does not name the t1 client: $(grep 'NBD client' "$SERVER_LOG" | tail -n 3)"
log "ok: a certificate the CA signed is enough; without one: $out"
stop_server || fail "the server did not stop cleanly"

# 2. --tls-allow-name narrows it (the start is waited for with t1's certificate).
TLS_CLIENT_DIR=$P/t1
start_tls_server --memory 16M --tls require --tls-certificates "$P/server" --tls-allow-name t1 --tls-allow-name backup.example
assert_eq "t1 with --tls-allow-name t1" "$(size_with "$P/t1")" $SIZE
out=$(size_with "$P/t2")
[[ $out == refused:* && $out == *"policy"* ]] || fail "t2 with --tls-allow-name t1: $out"
out=$(reply_with "$P/t2")
[[ $out == "$POLICY "* && $out == *'"t2"'* && $out == *"--tls-allow-name"* ]] || fail "the refusal of t2 does not name it and the flag: $out"
grep -q 'open refused (policy).*"t2".*--tls-allow-name' "$SERVER_LOG" || fail "the refusal of t2 is not logged: $(grep -i refused "$SERVER_LOG" | tail -n 3)"
out=$(reply_with "$P/client")
[[ $out == "$POLICY "* ]] || fail "a role certificate not named by --tls-allow-name: $out"
log "ok: --tls-allow-name t1 serves t1 and refuses t2 ($out)"
stop_server || fail "the server did not stop cleanly"

# 3. A certificate that fails verification is refused at the TLS handshake, never anonymous.
start_tls_server --memory 16M --tls require --tls-certificates "$P/server" --anonymous all \
    --handshake-penalty 3 --handshake-penalty-exempt none
assert_eq "no certificate with --anonymous all" "$(size_with "$P/nocert" tcp)" $SIZE
for bad in stranger expired; do
    out=$(size_with "$P/$bad" tcp)
    [[ $out == refused:* ]] || fail "a client certificate ($bad) that fails verification was served (as anonymous): $out"
    log "ok: $bad refused: $out"
done
grep -q "TLS handshake failed" "$SERVER_LOG" || fail "the server log does not say the TLS handshake failed: $(tail -n 5 "$SERVER_LOG")"
out=$(size_with "$P/stranger" tcp)
[[ $out == refused:* ]] || fail "the third bad certificate was served: $out"
out=$(size_with "$P/nocert" tcp)
[[ $out == refused:* ]] || fail "an address that failed 3 TLS handshakes is not penalized: $out"
grep -q "closed at accept" "$SERVER_LOG" || fail "the penalty is not logged: $(tail -n 5 "$SERVER_LOG")"
log "ok: certificates of another CA and expired ones refused at the TLS handshake and penalized"
server_alive || fail "the server died"
stop_server || fail "the server did not stop cleanly"
