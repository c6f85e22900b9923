"""bench/nbd-flood.py — NBD clients that send large READs and never read the replies, and a
normal client measured meanwhile; used by tests/e2e/test-nbd-memory-flood.sh and
bench/nbd-flood.sh.

  nbd-flood.py SOCKET EXPORT PID [--conns 24] [--reads 40] [--size 32M] [--seconds 10]
               [--normal-uri URI]

Reads the server PID's VmRSS, then opens CONNS connections to EXPORT on the unix SOCKET
(fixed newstyle, NBD_OPT_GO, simple replies: the server must send every byte), sends
READS reads of SIZE bytes on each and reads nothing back. For SECONDS it samples the
server's VmRSS every 50 ms while a normal client (libnbd with its default settings, on
NORMAL_URI, default the same socket and export) reads 4 KiB at a time, one after another,
at offsets spread over the first 64 MiB. Then it closes the flood and prints one JSON
object:

  {"rss_before": bytes, "rss_peak": bytes, "growth": bytes, "flood_sent": requests,
   "normal_reads": n, "normal_errors": n, "latency_ms": {"p50", "p99", "max"}}

Every socket has a timeout; every loop is bounded in count or time.
"""
import argparse
import json
import os
import socket
import struct
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "e2e"))
from rawnbd import connect, handshake, REQUEST_MAGIC, CMD_READ  # noqa: E402


def rss(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def size_arg(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def normal_client(uri, seconds, out):
    import nbd
    h = nbd.NBD()
    h.connect_uri(uri)
    lat, errors = [], 0
    deadline = time.monotonic() + seconds
    i = 0
    while time.monotonic() < deadline:
        off = (i * 1_048_573 * 4096) % (64 << 20) // 4096 * 4096
        t = time.monotonic()
        try:
            h.pread(4096, off)
            lat.append(time.monotonic() - t)
        except nbd.Error:
            errors += 1
        i += 1
    h.shutdown()
    out["reads"], out["errors"], out["lat"] = len(lat), errors, lat


def main():
    p = argparse.ArgumentParser()
    p.add_argument("socket")
    p.add_argument("export")
    p.add_argument("pid", type=int)
    p.add_argument("--conns", type=int, default=24)
    p.add_argument("--reads", type=int, default=40)
    p.add_argument("--size", type=size_arg, default=32 << 20)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--normal-uri")
    a = p.parse_args()
    uri = a.normal_uri or f"nbd+unix:///{a.export}?socket={a.socket}"

    before = rss(a.pid)
    flood, sent = [], 0
    for _ in range(a.conns):
        s = connect(a.socket, timeout=10.0)
        # As little as the kernel allows: what the server sends waits in its own memory.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        handshake(s, a.export.encode())
        for k in range(a.reads):
            s.sendall(struct.pack(">IHHQQI", REQUEST_MAGIC, 0, CMD_READ, k + 1, 0, a.size))
            sent += 1
        flood.append(s)

    result = {}
    normal = threading.Thread(target=normal_client, args=(uri, a.seconds, result))
    normal.start()
    peak = before
    deadline = time.monotonic() + a.seconds
    while time.monotonic() < deadline:
        peak = max(peak, rss(a.pid))
        time.sleep(0.05)
    normal.join(a.seconds + 60)
    peak = max(peak, rss(a.pid))
    for s in flood:
        s.close()

    lat = sorted(result.get("lat", []))
    pick = lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1000, 3) if lat else None
    print(json.dumps({
        "rss_before": before, "rss_peak": peak, "growth": peak - before, "flood_sent": sent,
        "normal_reads": result.get("reads", 0), "normal_errors": result.get("errors", 0) + (0 if "reads" in result else 1),
        "latency_ms": {"p50": pick(0.5), "p99": pick(0.99), "max": pick(1.0)},
    }))


if __name__ == "__main__":
    main()
