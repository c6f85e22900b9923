"""rawnbd.py — a minimal NBD client on a raw socket, for the robustness tests.

It speaks just enough of the fixed-newstyle handshake (doc/proto.md) to reach the
transmission phase, and lets a test send bytes a real client never would. Every socket
operation has a timeout, so a misbehaving server cannot hang a test.
"""
import os
import socket
import struct
import time

NBDMAGIC = 0x4E42444D41474943
IHAVEOPT = 0x49484156454F5054
REPLY_MAGIC_OPT = 0x0003E889045565A9
REQUEST_MAGIC = 0x25609513
SIMPLE_REPLY_MAGIC = 0x67446698
OPT_GO = 7
REP_ACK = 1
REP_INFO = 3
INFO_EXPORT = 0
FLAG_C_FIXED_NEWSTYLE = 1
FLAG_C_NO_ZEROES = 2
CMD_READ, CMD_WRITE = 0, 1


class Disconnected(Exception):
    pass


def connect(path, timeout=10.0):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(timeout)
    s.connect(path)
    return s


def recv_exact(s, n):
    buf = b""
    while len(buf) < n:
        chunk = s.recv(n - len(buf))
        if not chunk:
            raise Disconnected(f"server closed after {len(buf)} of {n} bytes")
        buf += chunk
    return buf


def read_greeting(s):
    magic, opt, flags = struct.unpack(">QQH", recv_exact(s, 18))
    assert magic == NBDMAGIC and opt == IHAVEOPT, f"bad greeting {magic:#x} {opt:#x}"
    return flags


def handshake(s, name=b""):
    """Fixed newstyle + NBD_OPT_GO; returns (size, transmission flags)."""
    read_greeting(s)
    s.sendall(struct.pack(">I", FLAG_C_FIXED_NEWSTYLE | FLAG_C_NO_ZEROES))
    data = struct.pack(">I", len(name)) + name + struct.pack(">H", 0)
    s.sendall(struct.pack(">QII", IHAVEOPT, OPT_GO, len(data)) + data)
    size = flags = None
    while True:
        magic, opt, rtype, length = struct.unpack(">QIII", recv_exact(s, 20))
        assert magic == REPLY_MAGIC_OPT, f"bad option reply magic {magic:#x}"
        payload = recv_exact(s, length)
        if rtype == REP_INFO and struct.unpack(">H", payload[:2])[0] == INFO_EXPORT:
            size, flags = struct.unpack(">QH", payload[2:12])
        elif rtype == REP_ACK:
            assert size is not None, "NBD_OPT_GO acked without NBD_INFO_EXPORT"
            return size, flags
        elif rtype & 0x80000000:
            raise AssertionError(f"NBD_OPT_GO refused: {rtype:#x} {payload!r}")


def request(s, cmd, offset, length, cookie=1, flags=0, magic=REQUEST_MAGIC, payload=b""):
    s.sendall(struct.pack(">IHHQQI", magic, flags, cmd, cookie, offset, length) + payload)


def simple_reply(s):
    """Returns (error, cookie) of a simple reply header."""
    magic, error, cookie = struct.unpack(">IIQ", recv_exact(s, 16))
    assert magic == SIMPLE_REPLY_MAGIC, f"unexpected reply magic {magic:#x}"
    return error, cookie


def wait_closed(s, secs=10.0):
    """Read (and discard) until the server closes; fail if it stays open for secs."""
    deadline = time.monotonic() + secs
    got = 0
    while time.monotonic() < deadline:
        s.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            chunk = s.recv(65536)
        except socket.timeout:
            break
        except (ConnectionResetError, BrokenPipeError):
            return got
        if not chunk:
            return got
        got += len(chunk)
    raise AssertionError(f"server kept the connection open for {secs}s (sent {got} bytes)")


def garbage(n):
    return os.urandom(n)


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0
