"""bench/hardening-load.py — the hostile and idle clients of bench/hardening.sh.

  loris HOST PORT SLOW IDLE STOP
      SLOW slow-loris sockets (each sends a request line, then one header byte a second,
      never ending the head; a socket the server closes is opened again) and IDLE keep-alive
      connections (one complete GET /metrics each, answer read, then silent); runs until the
      file STOP exists (at most 600 s), then prints "reopened N" (slow sockets the server
      closed and we reopened).
  reports HOST PORT KNOWN_PREFIX KNOWN_IDS KNOWN_N KNOWN_BYTES UNKNOWN_N UNKNOWN_BYTES
      PUT /api/v1/targets/ID/agent: KNOWN_N reports of KNOWN_BYTES to KNOWN_PREFIX1..KNOWN_IDS
      (round robin), then UNKNOWN_N of UNKNOWN_BYTES to ids no record has; prints the count
      of each HTTP status ("200:500 404:500"; "err": the connection was reset before an
      answer could be read). One connection per report.
  nbdhold URI N STATUS STOP
      opens N libnbd connections (handshake and get_size each), writes "K done" or
      "K failed: WHY" to STATUS, holds them until STOP exists (at most 600 s), closes them.
Every socket has a timeout; every loop is bounded in count or time.
"""
import http.client
import json
import os
import socket
import sys
import time


def loris(host, port, slow, idle, stop):
    deadline = time.monotonic() + 600
    head = b"GET /metrics HTTP/1.1\r\nHost: " + host.encode() + b"\r\nX-Slow: "

    def open_slow():
        s = socket.create_connection((host, port), timeout=5)
        s.setblocking(False)
        s.send(head[:1])
        return [s, 1]

    slows = [open_slow() for _ in range(slow)]
    idles = []
    for _ in range(idle):
        c = http.client.HTTPConnection(host, port, timeout=15)
        try:
            c.request("GET", "/metrics", headers={"Connection": "keep-alive"})
            c.getresponse().read()
        except OSError:
            pass
        idles.append(c)
    reopened = 0
    while not os.path.exists(stop) and time.monotonic() < deadline:
        for i, (s, sent) in enumerate(slows):
            byte = head[sent:sent + 1] or b"a"
            try:
                s.send(byte)
                slows[i][1] = sent + 1
            except BlockingIOError:
                pass
            except OSError:
                s.close()
                try:
                    slows[i] = open_slow()
                    reopened += 1
                except OSError:
                    pass
        time.sleep(1)
    for s, _ in slows:
        s.close()
    for c in idles:
        c.close()
    print(f"reopened {reopened}")


def reports(host, port, prefix, known_ids, known_n, known_bytes, unknown_n, unknown_bytes):
    counts = {}

    def put(tid, size):
        # One connection per report, so a refusal that closes the connection (a 413
        # before the body is read) still shows its status: the body is sent as far as
        # the server takes it, then the answer is read.
        doc = {"target": tid, "pad": ""}
        doc["pad"] = "x" * (size - len(json.dumps(doc)))
        body = json.dumps(doc).encode()
        head = (f"PUT /api/v1/targets/{tid}/agent HTTP/1.1\r\nHost: {host}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n").encode()
        key = "err"
        try:
            with socket.create_connection((host, port), timeout=30) as s:
                s.sendall(head)
                try:
                    s.sendall(body)
                except OSError:
                    pass
                data = s.recv(64)
                if data.startswith(b"HTTP/1.1 "):
                    key = data[9:12].decode()
        except OSError:
            pass
        counts[key] = counts.get(key, 0) + 1

    for i in range(known_n):
        put(f"{prefix}{i % known_ids + 1}", known_bytes)
    for i in range(unknown_n):
        put(f"forged{i + 1}", unknown_bytes)
    print(" ".join(f"{k}:{v}" for k, v in sorted(counts.items())))


def nbdhold(uri, n, status, stop):
    import nbd

    def say(text):
        with open(status + ".tmp", "w") as f:
            f.write(text)
        os.replace(status + ".tmp", status)

    handles, why = [], None
    for i in range(n):
        h = nbd.NBD()
        try:
            h.connect_uri(uri)
            h.get_size()
        except nbd.Error as e:
            why = f"connection {i + 1}: {e}".replace("\n", " ")
            break
        handles.append(h)
    say(f"{len(handles)} failed: {why}" if why else f"{len(handles)} done")
    deadline = time.monotonic() + 600
    while not os.path.exists(stop) and time.monotonic() < deadline:
        time.sleep(0.1)
    for h in handles:
        try:
            h.shutdown()
        except nbd.Error:
            pass
    handles.clear()


if __name__ == "__main__":
    cmd, a = sys.argv[1], sys.argv[2:]
    if cmd == "loris":
        loris(a[0], int(a[1]), int(a[2]), int(a[3]), a[4])
    elif cmd == "reports":
        reports(a[0], int(a[1]), a[2], int(a[3]), int(a[4]), int(a[5]), int(a[6]), int(a[7]))
    elif cmd == "nbdhold":
        nbdhold(a[0], int(a[1]), a[2], a[3])
    else:
        sys.exit(f"unknown command {cmd}")
