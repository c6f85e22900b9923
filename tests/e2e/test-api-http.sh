#!/usr/bin/env bash
# The HTTP API with curl and raw sockets: routes answer JSON with the right statuses
# (200, 201, 400, 404, 405, 409, 413); /metrics is Prometheus text that every line of
# parses; an agent's report shows in its target; malformed requests (garbage, bad
# Content-Length, oversized head, invalid UTF-8, truncated body, a stalled client) get
# a 4xx JSON answer or a closed connection, and the server keeps answering throughout.
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

# expect_status WHAT WANT METHOD PATH [JSON] — the answer's status, and JSON with
# error and what_to_do for 4xx.
expect_status() {
    local what=$1 want=$2; shift 2
    api "$@" >"$E2E_TMP/resp" || fail "$what: curl failed"
    local status
    status=$(tail -n1 "$E2E_TMP/resp")
    sed '$d' "$E2E_TMP/resp" >"$E2E_TMP/body"
    assert_eq "$what: status" "$status" "$want"
    if ((status >= 400)); then
        json_get "$E2E_TMP/body" 'j["error"] and j["what_to_do"]' >/dev/null || fail "$what: not an error document: $(cat "$E2E_TMP/body")"
    fi
}

expect_status "server" 200 GET /api/v1/server
assert_eq "server store" "$(json_get "$E2E_TMP/body" 'j["store"]')" "$STORE"
expect_status "vdisks" 200 GET /api/v1/vdisks
expect_status "new version" 201 POST /api/v1/vdisks/win/versions '{"note": "n"}'
expect_status "second maintenance version" 409 POST /api/v1/vdisks/win/versions '{}'
expect_status "promote" 200 POST /api/v1/vdisks/win/versions/1/promote '{"to": "test"}'
expect_status "promote to nowhere" 400 POST /api/v1/vdisks/win/versions/1/promote '{"to": "nowhere"}'
expect_status "unknown vDisk" 404 GET /api/v1/vdisks/nope
expect_status "add target" 201 POST /api/v1/targets '{"id": "vm1", "vdisk": "win", "cache": "server", "version": "test"}'
expect_status "patch target" 200 PUT /api/v1/targets/vm1 '{"description": "rack 4"}'
assert_eq "patched" "$(json_get "$E2E_TMP/body" '(j["version"], j["description"], j["generation"])')" "('test', 'rack 4', 2)"
expect_status "unknown target" 404 GET /api/v1/targets/vm9
expect_status "wrong method" 405 DELETE /api/v1/vdisks
expect_status "unknown route" 404 GET /api/v2/things
expect_status "malformed JSON" 400 POST /api/v1/targets '{"id": '

# An agent's report shows in its target and in /metrics.
report='{"target": "vm1", "pid": 1, "state": "running", "server": {"endpoint": "nbd://a/", "connected": true, "retries": 4, "reconnects": 2, "failovers": 1, "gave_up": 0}, "cache": {"used_percent": 30.5}}'
expect_status "agent report" 200 PUT /api/v1/targets/vm1/agent "$report"
expect_status "report for a target with no record" 404 PUT /api/v1/targets/vm2/agent "$report"
json_get "$E2E_TMP/body" '"vdstream target add vm2" in j["what_to_do"]' | grep -qx True || fail "the refusal does not say to add the target: $(cat "$E2E_TMP/body")"
expect_status "add target vm2" 201 POST /api/v1/targets '{"id": "vm2", "vdisk": "win", "cache": "server"}'
expect_status "report naming another target" 409 PUT /api/v1/targets/vm2/agent "$report"
expect_status "target with report" 200 GET /api/v1/targets/vm1
assert_eq "agent retries" "$(json_get "$E2E_TMP/body" 'j["agent"]["server"]["retries"]')" 4
curl -sS --max-time 30 "$API_URL/metrics" >"$E2E_TMP/metrics" || fail "GET /metrics failed"
"$PY" - "$E2E_TMP/metrics" <<'PY' || fail "/metrics is not Prometheus text: $(head -c 600 "$E2E_TMP/metrics")"
import re, sys
text = open(sys.argv[1]).read()
typed = set()
sample = re.compile(r'^([a-z_:][a-z0-9_:]*)(\{([a-z_]+="([^"\\]|\\.)*",?)*\})? (-?[0-9.e+]+|NaN|\+Inf|-Inf)$')
for line in text.splitlines():
    if line.startswith("# TYPE "):
        typed.add(line.split()[2])
    elif line.startswith("# HELP "):
        pass
    else:
        m = sample.match(line)
        assert m, line
        assert m.group(1) in typed, "no TYPE before " + line
assert 'vdstream_agent_retries_total{target="vm1"} 4' in text
assert "vdstream_sessions 0" in text
PY
log "ok: /metrics parses"

# Raw bytes: each gets a 4xx answer or a closed connection, never a hang or a crash. What
# hyper refuses before it is a request (garbage, a bad Content-Length, an oversized head)
# gets its bare status; what the API refuses, the JSON error document.
"$PY" - "${API_URL#http://}" <<'PY' || fail "a malformed request was mishandled"
import json, socket, sys
host, port = sys.argv[1].rsplit(":", 1)
addr = (host, int(port))

def send(raw, half_close=True):
    s = socket.create_connection(addr, timeout=20)
    out = b""
    try:
        s.sendall(raw)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        while True:
            b = s.recv(65536)
            if not b:
                break
            out += b
    except OSError:
        # hyper answers a head it refuses and closes at once: the rest of what we send
        # may reset the connection (and the answer with it).
        pass
    s.close()
    return out

cases = [
    ("garbage", b"\x00\x01GARBAGE\r\n\r\n", 400, False),
    ("bad Content-Length", b"POST /api/v1/targets HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1x\r\n\r\n", 400, False),
    ("oversized head", b"GET /api/v1/server HTTP/1.1\r\nHost: 127.0.0.1\r\nX: " + b"a" * 40000 + b"\r\n\r\n", 431, False),
    ("invalid UTF-8 body", b"POST /api/v1/targets HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 3\r\n\r\n\xff\xfe\xfd", 400, True),
    ("truncated body", b"POST /api/v1/targets HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 100\r\n\r\n{}", 400, True),
    ("body too large", b"POST /api/v1/targets HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 99999999\r\n\r\n", 413, True),
    ("agent report too large", b"PUT /api/v1/targets/vm1/agent HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 70000\r\n\r\n", 413, True),
]
for what, raw, want, is_json in cases:
    out = send(raw)
    if not out and not is_json:
        print("ok:", what, "closed", file=sys.stderr)
        continue
    head, _, body = out.partition(b"\r\n\r\n")
    status = int(head.split(b" ")[1])
    assert status == want, (what, out[:300])
    if not is_json:
        print("ok:", what, status, file=sys.stderr)
        continue
    doc = json.loads(body)
    assert doc["error"] and doc["what_to_do"], (what, doc)
    print("ok:", what, status, doc["error"][:80], file=sys.stderr)

# A stalled client does not block the others.
stalled = socket.create_connection(addr, timeout=20)
stalled.sendall(b"GET /api/v1/serv")
out = send(b"GET /api/v1/server HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
assert out.startswith(b"HTTP/1.1 200 "), out[:200]
stalled.close()
PY
expect_status "still answering" 200 GET /api/v1/server
server_alive "$API_PID" || fail "the API process died"
log "ok: the HTTP API"
