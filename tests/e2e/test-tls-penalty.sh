#!/usr/bin/env bash
# Handshake penalties (--handshake-penalty, as OpenSSH's PerSourcePenalties): a client
# address whose certificates the server keeps refusing (another CA's, from 127.0.0.2) has
# its connections closed at accept, with no greeting and no TLS work, once it reaches the
# limit; the log names the address and the flag; a good client on 127.0.0.1 (exempt by
# default) and one on another address are served all the while; --handshake-penalty 0
# turns it off; a bad exempt list is refused at start, naming the flag.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdinfo
require_vdstream
e2e_init
# shellcheck source=tls-lib.sh
source "$E2E_DIR/tls-lib.sh"

make_pki "$E2E_TMP/pki"
TLS_CLIENT_DIR=$E2E_TMP/pki/client
make_ca "$E2E_TMP/pki/other" "another CA"
issue "$E2E_TMP/pki/other" "$E2E_TMP/pki/stranger" client "URI:urn:vdstream:target:pc-01"

# attempts SOURCE N — N connections from SOURCE, each offering the stranger's certificate
# over STARTTLS; prints how they ended, one word each: refused (the TLS handshake was
# refused), closed (closed at accept: no greeting) or served.
attempts() {
    PYTHONPATH=$E2E_DIR "$PY" - "$PORT" "$1" "$2" "$E2E_TMP/pki/ca/ca-cert.pem" "$E2E_TMP/pki/stranger" <<'PYEOF'
import socket, ssl, struct, sys
from rawnbd import Disconnected, recv_exact
port, source, n, ca, certs = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5]
ctx = ssl.create_default_context(cafile=ca)
ctx.load_cert_chain(f"{certs}/client-cert.pem", f"{certs}/client-key.pem")
for _ in range(n):
    with socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0)) as s:
        try:
            recv_exact(s, 18)
        except (Disconnected, ConnectionResetError):
            print("closed"); continue
        s.sendall(struct.pack(">I", 3) + struct.pack(">QII", 0x49484156454F5054, 5, 0))
        recv_exact(s, 20)
        try:
            t = ctx.wrap_socket(s, server_hostname="localhost")
            t.sendall(struct.pack(">QII", 0x49484156454F5054, 2, 0))   # ABORT
            recv_exact(t, 20)
            print("served")
        except (ssl.SSLError, Disconnected, ConnectionResetError, BrokenPipeError):
            print("refused")
PYEOF
}

start_tls_server --memory 16M --tls require --tls-certificates "$E2E_TMP/pki/server" --handshake-penalty 3
assert_eq "three foreign certificates from 127.0.0.2" "$(attempts 127.0.0.2 3 | paste -sd' ')" "refused refused refused"
assert_eq "then 127.0.0.2 is closed at accept" "$(attempts 127.0.0.2 2 | paste -sd' ')" "closed closed"
grep -q "from 127.0.0.2.*closed at accept for 30s.*--handshake-penalty" "$SERVER_LOG" ||
    fail "the log does not name the penalized address and the flag: $(grep -i penal "$SERVER_LOG" | tail -3)"
log "ok: the log says: $(grep -o "NBD clients from 127.0.0.2.*" "$SERVER_LOG" | head -1)"
# The good client (127.0.0.1, exempt) and another address are served all the while.
assert_eq "nbdinfo from 127.0.0.1 during the penalty" "$(run_bounded 20 nbdinfo --size "$TLS_URI_TCP")" $((16 << 20))
assert_eq "another address's first foreign certificate" "$(attempts 127.0.0.3 1)" refused
# 127.0.0.1 itself is never penalized by default.
assert_eq "five foreign certificates from 127.0.0.1" "$(attempts 127.0.0.1 5 | sort -u)" refused
assert_eq "nbdinfo from 127.0.0.1 after its own failures" "$(run_bounded 20 nbdinfo --size "$TLS_URI_TCP")" $((16 << 20))
server_alive || fail "server died"
stop_server || fail "server did not stop cleanly"

# --handshake-penalty 0: no penalties.
start_tls_server --memory 16M --tls require --tls-certificates "$E2E_TMP/pki/server" --handshake-penalty 0
assert_eq "twelve foreign certificates with penalties off" "$(attempts 127.0.0.2 12 | sort -u)" refused
stop_server || fail "server did not stop cleanly"

# A bad exempt list is refused at start.
rc=0
out=$("$VDSTREAM_BIN" serve-image --memory 1M --socket "$E2E_TMP/bad.sock" --handshake-penalty-exempt lab-net 2>&1) || rc=$?
((rc != 0)) || fail "serve-image with --handshake-penalty-exempt lab-net started"
grep -q -- "--handshake-penalty-exempt.*lab-net" <<<"$out" || fail "the error does not name the flag and the value: $out"
log "ok: a bad exempt list is refused: $(tail -1 <<<"$out")"
