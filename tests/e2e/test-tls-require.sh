#!/usr/bin/env bash
# `--tls require`: a plaintext client gets NBD_REP_ERR_TLS_REQD (nbdinfo prints the
# server's message), the connection stays usable and upgrades with NBD_OPT_STARTTLS
# (a raw client: LIST -> TLS_REQD, STARTTLS -> ACK, TLS, a second STARTTLS -> INVALID,
# GO, one read); a client certificate from another CA and an expired one are refused;
# a client that stops in the middle of the TLS handshake is dropped after the stated
# --handshake-timeout; `--tls on` serves plaintext clients too; bad flag combinations
# are refused at start.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdinfo
require_python_nbd
require_vdstream
e2e_init
# shellcheck source=tls-lib.sh
source "$E2E_DIR/tls-lib.sh"

make_pki "$E2E_TMP/pki"
TLS_CLIENT_DIR=$E2E_TMP/pki/client
start_tls_server --memory 16M --tls require --tls-certificates "$E2E_TMP/pki/server" --handshake-timeout 3

# 1. Plaintext nbdinfo: refused with the server's message.
rc=0
out=$(run_bounded 20 nbdinfo --size "nbd+unix:///vdstream?socket=$SOCK" 2>&1) || rc=$?
((rc != 0)) || fail "a plaintext client was served by a --tls require server: $out"
grep -qi "requires TLS" <<<"$out" || fail "nbdinfo did not show the server's TLS_REQD message: $out"
log "ok: plaintext nbdinfo refused: $(head -1 <<<"$out")"

# 2. A raw client: TLS_REQD, the connection stays usable, STARTTLS, then GO over TLS.
"$PY" - "$SOCK" "$TLS_CLIENT_DIR" <<'PYEOF' || fail "the raw STARTTLS upgrade failed"
import socket, ssl, struct, sys
sock_path, certs = sys.argv[1], sys.argv[2]
OPT_GO, OPT_LIST, OPT_STARTTLS = 7, 3, 5
REP_ACK, ERR_TLS_REQD, ERR_INVALID = 1, 0x80000005, 0x80000001 + 2
def recv_exact(s, n):
    b = b""
    while len(b) < n:
        c = s.recv(n - len(b))
        assert c, f"closed after {len(b)} of {n} bytes"
        b += c
    return b
def option(s, opt, data=b""):
    s.sendall(struct.pack(">QII", 0x49484156454F5054, opt, len(data)) + data)
def reply(s):
    magic, opt, rtype, length = struct.unpack(">QIII", recv_exact(s, 20))
    assert magic == 0x0003E889045565A9
    return opt, rtype, recv_exact(s, length)
s = socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect(sock_path)
recv_exact(s, 18)
s.sendall(struct.pack(">I", 3))
for opt in (OPT_LIST, OPT_GO, OPT_LIST):
    data = struct.pack(">I", 0) + struct.pack(">H", 0) if opt == OPT_GO else b""
    option(s, opt, data)
    o, rtype, msg = reply(s)
    assert (o, rtype) == (opt, ERR_TLS_REQD), (o, hex(rtype), msg)
print("before TLS: TLS_REQD:", msg.decode())
option(s, OPT_STARTTLS)
assert reply(s)[1] == REP_ACK
ctx = ssl.create_default_context(cafile=f"{certs}/ca-cert.pem")
ctx.load_cert_chain(f"{certs}/client-cert.pem", f"{certs}/client-key.pem")
t = ctx.wrap_socket(s, server_hostname="localhost")
option(t, OPT_STARTTLS)
o, rtype, msg = reply(t)
assert rtype == ERR_INVALID, hex(rtype)
print("second STARTTLS:", msg.decode())
name = b"vdstream"
option(t, OPT_GO, struct.pack(">I", len(name)) + name + struct.pack(">H", 0))
while True:
    o, rtype, payload = reply(t)
    assert not rtype & 0x80000000, (hex(rtype), payload)
    if rtype == REP_ACK:
        break
t.sendall(struct.pack(">IHHQQI", 0x25609513, 0, 0, 7, 4096, 4096))   # READ
magic, err, cookie = struct.unpack(">IIQ", recv_exact(t, 16))
assert (magic, err, cookie) == (0x67446698, 0, 7), (hex(magic), err, cookie)
assert recv_exact(t, 4096) == bytes(4096)
print("upgraded and read 4 KiB over TLS")
PYEOF
log "ok: TLS_REQD keeps the connection usable; STARTTLS upgrades it; a second STARTTLS is invalid"

# tls_go_with DIR: STARTTLS and NBD_OPT_GO showing DIR's client certificate (python's ssl
# sends it whatever CA the server names); prints "served" or "refused: WHY".
tls_go_with() {
    "$PY" - "$SOCK" "$E2E_TMP/pki/ca/ca-cert.pem" "$1" <<'PYEOF'
import socket, ssl, struct, sys
sock_path, ca, certs = sys.argv[1:4]
s = socket.socket(socket.AF_UNIX); s.settimeout(10); s.connect(sock_path)
s.recv(18); s.sendall(struct.pack(">I", 3))
s.sendall(struct.pack(">QII", 0x49484156454F5054, 5, 0)); s.recv(20)
ctx = ssl.create_default_context(cafile=ca)
ctx.load_cert_chain(f"{certs}/client-cert.pem", f"{certs}/client-key.pem")
try:
    t = ctx.wrap_socket(s, server_hostname="localhost")
    name = b"vdstream"
    t.sendall(struct.pack(">QII", 0x49484156454F5054, 7, len(name) + 6) + struct.pack(">I", len(name)) + name + b"\0\0")
    hdr = t.recv(20)
    print("served" if len(hdr) == 20 else "refused: the server closed the connection")
except (ssl.SSLError, OSError) as e:
    print(f"refused: {e}")
PYEOF
}
assert_eq "the right CA's certificate" "$(tls_go_with "$TLS_CLIENT_DIR")" served

# 3. A client certificate signed by another CA: refused by the server; and a client that
#    trusts another CA refuses the server.
make_ca "$E2E_TMP/pki/other" "another CA"
issue "$E2E_TMP/pki/other" "$E2E_TMP/pki/stranger" client "URI:urn:vdstream:target:pc-01"
out=$(tls_go_with "$E2E_TMP/pki/stranger")
[[ $out == refused* ]] || fail "a certificate from another CA was accepted: $out"
log "ok: a client certificate from another CA is refused ($out)"
rc=0
out=$(run_bounded 20 nbdinfo --size "nbds://127.0.0.1:$PORT/vdstream?tls-certificates=$E2E_TMP/pki/stranger" 2>&1) || rc=$?
((rc != 0)) || fail "a client trusting another CA accepted the server"
log "ok: a client trusting another CA refuses the server ($(tail -1 <<<"$out"))"

# 4. An expired client certificate from the right CA: refused, and the log says why.
issue "$E2E_TMP/pki/ca" "$E2E_TMP/pki/expired" client "URI:urn:vdstream:target:old" \
    -startdate 20200101000000Z -enddate 20200201000000Z
out=$(tls_go_with "$E2E_TMP/pki/expired")
[[ $out == refused* ]] || fail "an expired certificate was accepted: $out"
grep -qi "expired" "$SERVER_LOG" || fail "the server log does not say why: $(tail -5 "$SERVER_LOG")"
log "ok: an expired certificate is refused ($out)"

# 5. A slow-loris: STARTTLS acknowledged, then half a ClientHello and silence: dropped
#    after --handshake-timeout 3 (not before 2 s, well before 10 s).
"$PY" - "$SOCK" <<'PYEOF' || fail "the stalled TLS handshake was not dropped in time"
import socket, struct, sys, time
s = socket.socket(socket.AF_UNIX); s.settimeout(20); s.connect(sys.argv[1])
s.recv(18); s.sendall(struct.pack(">I", 3))
s.sendall(struct.pack(">QII", 0x49484156454F5054, 5, 0))
hdr = s.recv(20); assert struct.unpack(">QIII", hdr)[2] == 1, hdr
s.sendall(bytes([0x16, 0x03, 0x01, 0x02, 0x00, 0x01]))   # a record header and 1 byte of 512
t0 = time.monotonic()
try:
    got = s.recv(100)
except ConnectionResetError:
    got = b""
took = time.monotonic() - t0
assert got == b"", got
assert 2.0 <= took <= 10.0, f"dropped after {took:.1f}s"
print(f"dropped after {took:.1f}s")
PYEOF
log "ok: a client stalled in the TLS handshake is dropped after the handshake timeout"
server_alive || fail "server died"
stop_server || fail "server did not stop cleanly"

# 6. --tls on: a plaintext client is anonymous, refused by default (NBD_REP_ERR_POLICY,
#    saying how to get in) and served with --anonymous all; TLS clients are served.
start_tls_server --memory 16M --tls on --tls-certificates "$E2E_TMP/pki/server"
rc=0
out=$(LIBNBD_DEBUG=1 run_bounded 20 nbdinfo --size "nbd+unix:///vdstream?socket=$SOCK" 2>&1) || rc=$?
((rc != 0)) || fail "a plaintext (anonymous) client was served by --tls on without --anonymous all"
grep -q "without a verified certificate" <<<"$out" || fail "the refusal does not say why: $out"
log "ok: --tls on refuses an anonymous plaintext client by default"
assert_eq "TLS size with --tls on" "$(run_bounded 20 nbdinfo --size "$TLS_URI_TCP")" $((16 << 20))
stop_server || fail "server did not stop cleanly"
start_tls_server --memory 16M --tls on --tls-certificates "$E2E_TMP/pki/server" --anonymous all
assert_eq "plaintext size with --tls on --anonymous all" "$(run_bounded 20 nbdinfo --size "nbd+unix:///vdstream?socket=$SOCK")" $((16 << 20))
stop_server || fail "server did not stop cleanly"

# 7. Flags that do not go together are refused at start, saying what to do.
for bad in "--tls require" "--tls-certificates $E2E_TMP/pki/server" "--tls on --tls-certificates $E2E_TMP/pki/nowhere" \
    "--tls require --tls-certificates $E2E_TMP/pki/server --tls-verify-peer false"; do
    rc=0
    # shellcheck disable=SC2086
    out=$("$VDSTREAM_BIN" serve-image --memory 1M --socket "$E2E_TMP/bad.sock" $bad 2>&1) || rc=$?
    ((rc != 0)) || fail "serve-image $bad started"
    grep -q -- "--tls" <<<"$out" || fail "serve-image $bad: the error does not name the flag: $out"
    log "ok: serve-image $bad refused: $(tail -1 <<<"$out")"
done
