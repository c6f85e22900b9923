#!/usr/bin/env bash
# Bad requests in the transmission phase: a request with a bad magic gets the connection
# closed (bounded); an unknown command type gets EINVAL and the connection stays usable;
# a write header announcing a 4 GiB payload is refused (EINVAL or disconnect) without the
# server allocating it; nbdinfo works during and after each.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdinfo
[[ -x $PY ]] || skip "$PY not found"
e2e_init

start_server --memory 64M
PYTHONPATH=$E2E_DIR run_bounded 120 "$PY" - "$SOCK" "$SERVER_PID" "$URI" <<'PYEOF' || fail "bad request checks failed"
import errno, struct, subprocess, sys
from rawnbd import *
sock, pid, uri = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def nbdinfo_ok(when):
    r = subprocess.run(["nbdinfo", "--size", uri], capture_output=True, text=True, timeout=20)
    assert r.returncode == 0 and r.stdout.strip() == str(64 << 20), f"nbdinfo {when}: {r.stderr}"

rss0 = rss_kib(pid)

# 1. Good read first (the raw client works at all), then a bad request magic.
s = connect(sock)
size, _ = handshake(s)
assert size == 64 << 20, size
request(s, CMD_READ, 0, 4096, cookie=7)
err, cookie = simple_reply(s)
assert (err, cookie) == (0, 7), (err, cookie)
assert recv_exact(s, 4096) == bytes(4096)
request(s, CMD_READ, 0, 4096, cookie=8, magic=0x12345678)
nbdinfo_ok("while the bad-magic connection is open")
wait_closed(s, 10)
s.close()
nbdinfo_ok("after a bad request magic")
print("ok: bad request magic: disconnected")

# 2. Unknown command type 99 -> EINVAL, connection still usable.
s = connect(sock)
handshake(s)
request(s, 99, 0, 4096, cookie=9)
err, cookie = simple_reply(s)
assert cookie == 9 and err == errno.EINVAL, f"unknown command: error {err} cookie {cookie}, want EINVAL"
request(s, CMD_READ, 4096, 512, cookie=10)
err, cookie = simple_reply(s)
assert (err, cookie) == (0, 10), (err, cookie)
recv_exact(s, 512)
s.close()
print("ok: unknown command: EINVAL, connection usable")

# 3. Write header announcing 4 GiB - 1 of payload, then only a few bytes and a stall.
s = connect(sock)
handshake(s)
request(s, CMD_WRITE, 0, 0xFFFFFFFF, cookie=11, payload=b"x" * 1000)
nbdinfo_ok("while a 4 GiB write header is pending")
try:
    s.settimeout(10)
    err, cookie = simple_reply(s)
    assert err == errno.EINVAL, f"oversized write: error {err}, want EINVAL"
    print("ok: oversized write: EINVAL")
except (Disconnected, ConnectionResetError):
    print("ok: oversized write: disconnected")
except TimeoutError:
    raise AssertionError("server neither answered nor closed after a 4 GiB write header")
s.close()
nbdinfo_ok("after the oversized write")

rss1 = rss_kib(pid)
print(f"server RSS {rss0} KiB before, {rss1} KiB after")
assert rss1 < rss0 + 256 * 1024, f"server RSS grew by {(rss1 - rss0) >> 10} MiB"
PYEOF
server_alive "$SERVER_PID" || fail "server died"
