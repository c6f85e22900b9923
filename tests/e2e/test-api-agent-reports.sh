#!/usr/bin/env bash
# Agent reports (PUT /api/v1/targets/ID/agent) cost the server bounded memory, whoever
# sends them: 600 reports of the largest size allowed, for 200 targets of the store, grow
# the server's RSS (/proc/PID/status VmRSS); once they expire (60 s) it returns to within
# a margin of its baseline. A report for a target with no record is refused (404, naming
# `vdstream target add`), and one over 64 KiB too (413), so a forger cannot grow the
# server by inventing targets.
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

rss_kib() { awk '/^VmRSS:/ {print $2}' "/proc/$API_PID/status"; }

# PY_REPORTS ROUNDS — 200 targets t0..t199 (added on the first call), then ROUNDS reports
# of about 63 KiB each for each of them, on one keep-alive connection.
send_reports() {
    "$PY" - "${API_URL#http://}" "$1" <<'PY'
import http.client, json, sys
host, port = sys.argv[1].rsplit(":", 1)
rounds = int(sys.argv[2])
c = http.client.HTTPConnection(host, int(port), timeout=30)
def call(method, path, body):
    c.request(method, path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    return r.status, r.read()
for i in range(200):
    st, body = call("POST", "/api/v1/targets", {"id": "t%d" % i, "vdisk": "win", "cache": "server"})
    assert st in (201, 409), (st, body)
for r in range(rounds):
    for i in range(200):
        report = {"target": "t%d" % i, "pid": 1000 + i, "state": "running",
                  "server": {"endpoint": "nbd://127.0.0.1/", "connected": True, "retries": r},
                  # The bulk in a field the server keeps (it keeps a report's Status
                  # fields only): the agent's socket path.
                  "socket": "/run/%d" % r + "x" * (63 * 1024)}
        st, body = call("PUT", "/api/v1/targets/t%d/agent" % i, report)
        assert st == 200, (st, body)
print("sent", rounds * 200)
PY
}

# Baseline: after a first round of every route the test uses, with no report kept.
send_reports 0 >/dev/null || fail "cannot add the targets"
api GET /api/v1/targets/t1 >/dev/null
base=$(rss_kib)
log "baseline RSS ${base} KiB"

send_reports 3 >/dev/null || fail "the reports were refused"
grown=$(rss_kib)
log "after 600 reports of 63 KiB: RSS ${grown} KiB"
((grown - base > 8 * 1024)) || fail "the reports did not grow the RSS by 8 MiB (${base} -> ${grown} KiB): the test measures nothing"
api GET /api/v1/targets/t7 >"$E2E_TMP/t7"
json_get <(sed '$d' "$E2E_TMP/t7") 'j["agent"]["pid"]' | grep -qx 1007 || fail "t7 does not show its report: $(cat "$E2E_TMP/t7")"

# Expiry after 60 s; the RSS must come back to the baseline plus 4 MiB within 80 s.
margin=$((4 * 1024))
back=
for ((i = 0; i < 80; i++)); do
    sleep 1
    now=$(rss_kib)
    if ((now <= base + margin)); then
        back=$now
        break
    fi
done
[[ -n $back ]] || fail "80 s after the reports, when they had expired, the RSS is ${now} KiB: not back to the baseline ${base} KiB (+${margin})"
log "ok: after expiry the RSS is ${back} KiB (baseline ${base}, peak ${grown}) after ${i} s"
api GET /api/v1/targets/t7 >"$E2E_TMP/t7"
json_get <(sed '$d' "$E2E_TMP/t7") '"agent" in j' | grep -qx False || fail "t7 still shows an expired report: $(cat "$E2E_TMP/t7")"

# Forged reports: unknown targets and oversized reports are refused.
api PUT /api/v1/targets/nosuch/agent '{"target": "nosuch", "state": "running"}' >"$E2E_TMP/forged"
assert_eq "report for a target with no record" "$(tail -n1 "$E2E_TMP/forged")" 404
json_get <(sed '$d' "$E2E_TMP/forged") '"vdstream target add nosuch" in j["what_to_do"] and "nosuch" in j["error"]' | grep -qx True \
    || fail "the refusal does not name the target and what to do: $(cat "$E2E_TMP/forged")"
big=$("$PY" -c 'import json; print(json.dumps({"target": "t1", "note": "x" * 70000}))')
api PUT /api/v1/targets/t1/agent "$big" >"$E2E_TMP/big"
assert_eq "report over 64 KiB" "$(tail -n1 "$E2E_TMP/big")" 413
grep -q "refused an agent report for target \"nosuch\"" "$API_LOG" || fail "the refusal is not in the server's log"
server_alive "$API_PID" || fail "the API process died"
log "ok: agent reports cost bounded memory and are refused for unknown targets"
