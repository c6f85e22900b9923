"""bench/nbd-flood.py — NBD clients that send large READs and never read the replies, and a
normal client measured meanwhile; used by tests/e2e/test-nbd-memory-flood.sh and
bench/nbd-flood.sh.

  nbd-flood.py SOCKET EXPORT PID [--conns 24] [--reads 40] [--size 32M] [--seconds 10]
               [--normal-uri URI] [--rss-cap SIZE] [--quiet-first SECONDS]

Reads the server PID's VmRSS, then opens CONNS connections to EXPORT on the unix SOCKET
(fixed newstyle, NBD_OPT_GO, simple replies: the server must send every byte), sends
READS reads of SIZE bytes on each and reads nothing back. For SECONDS it samples the
server's VmRSS every 50 ms while a normal client (libnbd with its default settings, on
NORMAL_URI, default the same socket and export) reads 4 KiB at a time, one after another,
at offsets spread over the first 64 MiB. Then it closes the flood and prints one JSON
object:

  {"rss_before": bytes, "rss_peak": bytes, "growth": bytes, "capped": bool, "server_died": bool,
   "flood_sent": requests, "normal_reads": n, "normal_errors": n,
   "latency_ms": {"p50", "p99", "max"}, "quiet": {...} (with --quiet-first)}

--rss-cap: the flood is closed as soon as the server's RSS passes SIZE ("capped": true;
the growth is then at least the cap less the RSS before), so that a server without a
bound cannot take the machine. --quiet-first: the normal client runs that long alone
first, for its latency without a flood ("quiet").

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
    """The VmRSS of `pid` in bytes; None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def size_arg(text):
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def normal_client(uri, seconds, out):
    import nbd
    lat, errors = [], 0
    out["reads"], out["errors"], out["lat"] = 0, 0, lat
    h = nbd.NBD()
    try:
        h.connect_uri(uri)
    except nbd.Error:
        out["errors"] = 1
        return
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
            if not h.aio_is_ready() and not h.aio_is_processing():
                break  # the connection is gone
        i += 1
    try:
        h.shutdown()
    except nbd.Error:
        pass
    out["reads"], out["errors"] = len(lat), errors


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
    p.add_argument("--rss-cap", type=size_arg)
    p.add_argument("--quiet-first", type=float, default=0.0)
    a = p.parse_args()
    uri = a.normal_uri or f"nbd+unix:///{a.export}?socket={a.socket}"

    quiet = {}
    if a.quiet_first > 0:
        normal_client(uri, a.quiet_first, quiet)
    before = rss(a.pid)
    flood, sent, capped = [], 0, False
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
    peak, died = before, False
    deadline = time.monotonic() + a.seconds
    while time.monotonic() < deadline:
        now = rss(a.pid)
        if now is None:
            died = True
            break
        peak = max(peak, now)
        if a.rss_cap and peak > a.rss_cap and not capped:
            capped = True
            for s in flood:
                s.close()
        time.sleep(0.05)
    normal.join(a.seconds + 60)
    peak = max(peak, rss(a.pid) or 0)
    if not capped:
        for s in flood:
            s.close()
    time.sleep(0.5)
    died = died or rss(a.pid) is None

    def latency(r):
        lat = sorted(r.get("lat", []))
        pick = lambda q: round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1000, 3) if lat else None
        return {"p50": pick(0.5), "p99": pick(0.99), "max": pick(1.0)}

    out = {
        "rss_before": before, "rss_peak": peak, "growth": peak - before, "capped": capped, "server_died": died, "flood_sent": sent,
        "normal_reads": result.get("reads", 0), "normal_errors": result.get("errors", 0),
        "latency_ms": latency(result),
    }
    if quiet:
        out["quiet"] = {"reads": quiet["reads"], "errors": quiet["errors"], "latency_ms": latency(quiet)}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
