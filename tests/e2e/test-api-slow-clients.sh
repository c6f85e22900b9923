#!/usr/bin/env bash
# Slow and hostile HTTP clients against `vdstream server --http` (the API runs as tasks of
# the server's tokio runtime): while 200 slow-loris connections each send part of a
# request head and then trickle a byte every half second or stall, a normal client gets
# every answer within 1 s (10 rounds); a body announced as 1 GB gets 413 within 1 s
# without the server reading it (the client sends 5 bytes and keeps the connection
# open); a body that trickles a byte a second gets 408 within the 10 s request deadline
# (and a little slack); malformed JSON gets 400 with the error document; afterwards the
# server still answers.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
source "$(dirname "$0")/api-lib.sh"
require curl
require_vdstream
e2e_init
store_init

vds vdisk create win --size 16M >/dev/null
start_api

"$PY" - "${API_URL#http://}" <<'PY' || fail "a slow client was mishandled"
import json, socket, sys, threading, time
host, port = sys.argv[1].rsplit(":", 1)
addr = (host, int(port))

def answer_of(s, budget):
    """Reads until the server closes or a whole head is in; (status, body, seconds)."""
    t0 = time.monotonic()
    s.settimeout(budget)
    out = b""
    while b"\r\n\r\n" not in out or not out.rstrip().endswith(b"}"):
        try:
            b = s.recv(65536)
        except socket.timeout:
            break
        if not b:
            break
        out += b
    took = time.monotonic() - t0
    head, _, body = out.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1]) if head.startswith(b"HTTP/1.") else None
    return status, body, took

def timed_get(path):
    t0 = time.monotonic()
    s = socket.create_connection(addr, timeout=1)
    s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
    status, _, _ = answer_of(s, 1)
    s.close()
    return status, time.monotonic() - t0

# 200 slow-loris connections: a partial head, then one byte every 0.5 s (half of them) or nothing.
loris = []
for i in range(200):
    s = socket.create_connection(addr, timeout=5)
    s.sendall(b"GET /api/v1/vdisks HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
    loris.append(s)
stop = threading.Event()
def trickle():
    for _ in range(16):
        for s in loris[::2]:
            try:
                s.send(b"a")
            except OSError:
                pass
        if stop.wait(0.5):
            return
t = threading.Thread(target=trickle)
t.start()
try:
    time.sleep(0.5)
    for round in range(10):
        for path in ["/api/v1/server", "/api/v1/vdisks", "/metrics"]:
            status, took = timed_get(path)
            assert status == 200 and took < 1.0, f"round {round}, {path}: status {status} after {took:.2f} s beside 200 slow-loris connections"
        time.sleep(0.3)
    print("ok: 30 answers within 1 s beside 200 slow-loris connections", file=sys.stderr)
finally:
    stop.set()
    t.join()
    for s in loris:
        s.close()

# 413 from Content-Length alone: the body is never sent, the connection stays open.
s = socket.create_connection(addr, timeout=5)
s.sendall(b"POST /api/v1/targets HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: 1000000000\r\n\r\n{\"id\"")
status, body, took = answer_of(s, 5)
s.close()
assert status == 413 and took < 1.0, f"an announced 1 GB body: status {status} after {took:.2f} s"
doc = json.loads(body)
assert doc["error"] and doc["what_to_do"], doc
print(f"ok: 413 after {took:.3f} s from Content-Length alone: {doc['error']}", file=sys.stderr)

# 408 for a body that trickles (a byte a second, never whole) within the deadline.
s = socket.create_connection(addr, timeout=5)
s.sendall(b"POST /api/v1/targets HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{")
t0 = time.monotonic()
status = None
for _ in range(20):
    try:
        s.send(b" ")
    except OSError:
        break
    s.settimeout(1)
    try:
        data = s.recv(65536)
    except socket.timeout:
        continue
    status = int(data.split(b" ")[1]) if data.startswith(b"HTTP/1.") else None
    body = data.partition(b"\r\n\r\n")[2]
    break
took = time.monotonic() - t0
s.close()
assert status == 408 and 9 < took < 13, f"a trickling body: status {status} after {took:.1f} s"
assert json.loads(body)["error"], body
print(f"ok: 408 after {took:.1f} s for a trickling body", file=sys.stderr)
PY

api POST /api/v1/targets '{"id": ' >"$E2E_TMP/resp" || fail "curl failed"
assert_eq "malformed JSON: status" "$(tail -n1 "$E2E_TMP/resp")" 400
sed '$d' "$E2E_TMP/resp" >"$E2E_TMP/body"
json_get "$E2E_TMP/body" 'j["error"] and j["what_to_do"]' >/dev/null || fail "malformed JSON: not an error document: $(cat "$E2E_TMP/body")"
api GET /api/v1/server >"$E2E_TMP/resp" || fail "curl failed"
assert_eq "still answering" "$(tail -n1 "$E2E_TMP/resp")" 200
server_alive "$API_PID" || fail "the API process died"
log "ok: slow clients hold only their own connections; 400, 408 and 413 as documented"
