#!/usr/bin/env bash
# Garbage during the handshake gets a clean disconnect (bounded), never a crash or a big
# allocation, and a well-behaved client (nbdinfo) works while a garbage connection is
# open and after all of them: random bytes before the greeting is read, unknown client
# flags, a bad option magic, an option claiming a 4 GiB payload, an oversized export name.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdinfo
[[ -x $PY ]] || skip "$PY not found"
e2e_init

start_server --memory 64M
PYTHONPATH=$E2E_DIR run_bounded 120 "$PY" - "$SOCK" "$SERVER_PID" "$URI" <<'PYEOF' || fail "garbage handshake checks failed"
import os, struct, subprocess, sys
from rawnbd import *
sock, pid, uri = sys.argv[1], int(sys.argv[2]), sys.argv[3]

def nbdinfo_ok(when):
    r = subprocess.run(["nbdinfo", "--size", uri], capture_output=True, text=True, timeout=20)
    assert r.returncode == 0 and r.stdout.strip() == str(64 << 20), f"nbdinfo {when}: {r.stderr}"

rss0 = rss_kib(pid)

def case(name, send, read_greeting_first=True, after_flags=False):
    s = connect(sock)
    if read_greeting_first:
        read_greeting(s)
    if after_flags:
        s.sendall(struct.pack(">I", FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES))
    s.sendall(send)
    nbdinfo_ok(f"while '{name}' is open")
    wait_closed(s, 10)
    s.close()
    nbdinfo_ok(f"after '{name}'")
    print(f"ok: {name}: disconnected, others unaffected")

case("random bytes before reading the greeting", garbage(64), read_greeting_first=False)
case("unknown client flags", struct.pack(">I", 0xFFFFFFFC) + garbage(32))
case("bad option magic", garbage(16) + b"\0" * 8, after_flags=True)
case("option header claiming a 4 GiB payload",
     struct.pack(">QII", IHAVEOPT, OPT_GO, 0xFFFFFFFF) + garbage(100), after_flags=True)
name = b"n" * 70000
data = struct.pack(">I", len(name)) + name + struct.pack(">H", 0)
case("NBD_OPT_GO with a 70000-byte export name (and then a close)",
     struct.pack(">QII", IHAVEOPT, OPT_GO, len(data)) + data + garbage(20000), after_flags=True)

rss1 = rss_kib(pid)
print(f"server RSS {rss0} KiB before, {rss1} KiB after")
assert rss1 < rss0 + 256 * 1024, f"server RSS grew by {(rss1 - rss0) >> 10} MiB on garbage input"
PYEOF
server_alive "$SERVER_PID" || fail "server died"
assert_eq "size after garbage" "$(nbdinfo --size "$URI")" $((64 * 1024 * 1024))
