#!/usr/bin/env bash
# An agent that reports to an open API (loopback, no token made) goes on reporting after
# an administrator makes the first token, or says why not:
#  - `vdstream token add` says that agents now need a token or their certificate, and how
#    to give them one;
#  - the agent, its report refused (401), logs it at WARN once, with what to do;
#  - the server counts the refused reports in /metrics and logs them;
#  - given an operator token in a file (VDSTREAM_TOKEN_FILE), an agent reports again.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
source "$(dirname "$0")/api-lib.sh"
source "$(dirname "$0")/agent-lib.sh"
require curl nbdinfo
require_vdstream
e2e_init
store_init

vds vdisk create win --size 16M >/dev/null
vds version new win >/dev/null
vds target add pc-01 --vdisk win --cache device-ram --ram 8M >/dev/null
start_api

# reported PID — whether the API shows pc-01's report from agent PID (with $1 as token).
reported() {
    local auth=()
    [[ -n ${2:-} ]] && auth=(-H "Authorization: Bearer $2")
    curl -sS --max-time 10 "${auth[@]}" "$API_URL/api/v1/targets/pc-01" >"$E2E_TMP/pc01.json" || return 1
    [[ $(json_get "$E2E_TMP/pc01.json" 'j.get("agent", {}).get("pid")') == "$1" ]]
}

start_agent pc-01 --server "$API_URL"
ok=
for _ in $(seq 50); do
    reported "$AGENT_PID" && ok=1 && break
    sleep 0.2
done
[[ -n $ok ]] || fail "the agent's report did not arrive on the open API: $(cat "$E2E_TMP/pc01.json")"
log "ok: the agent reports to the open API"

out=$(vds token add console --role admin 2>&1 >"$E2E_TMP/admin.token")
adm=$(cat "$E2E_TMP/admin.token")
for want in "agents" "VDSTREAM_TOKEN_FILE" "--role operator" "certificate"; do
    grep -q -- "$want" <<<"$out" || fail "token add does not tell about agents ('$want' missing): $out"
done
log "ok: token add says: $(grep -m1 agents <<<"$out")"

# The agent's next reports are refused: one WARN, saying what to do; counted and logged.
warned=
for _ in $(seq 100); do
    grep -q "WARN.*status report" "$AGENT_LOG" && warned=1 && break
    sleep 0.1
done
[[ -n $warned ]] || fail "the agent did not log its refused report at WARN within 10 s: $(tail -n 5 "$AGENT_LOG")"
line=$(grep -m1 "WARN.*status report" "$AGENT_LOG")
for want in "401" "VDSTREAM_TOKEN_FILE" "certificate"; do
    grep -q -- "$want" <<<"$line" || fail "the agent's warning does not say '$want': $line"
done
sleep 3 # three more reports, refused
assert_eq "warnings of refused reports in the agent's log" "$(grep -c "WARN.*status report" "$AGENT_LOG")" 1
metrics=$(curl -sS --max-time 10 -H "Authorization: Bearer $adm" "$API_URL/metrics")
n=$(awk '$1 == "vdstream_api_agent_reports_refused_total" {print $2}' <<<"$metrics")
[[ -n $n ]] && ((n >= 3)) || fail "/metrics does not count the refused reports (got '${n}'): $(grep agent_reports <<<"$metrics")"
grep -q "refused a status report of target pc-01" "$API_LOG" || fail "the server does not log the refused report: $(tail -n 5 "$API_LOG")"
log "ok: the agent warned once ($line); /metrics counts $n refused reports"
stop_server "$AGENT_PID" 15 || fail "the agent did not stop cleanly"

# With an operator token in a file, an agent reports again.
vds token add agents --role operator >"$E2E_TMP/agent.token" 2>/dev/null
chmod 600 "$E2E_TMP/agent.token"
VDSTREAM_TOKEN_FILE=$E2E_TMP/agent.token start_agent pc-01 --server "$API_URL"
ok=
for _ in $(seq 50); do
    reported "$AGENT_PID" "$adm" && ok=1 && break
    sleep 0.2
done
[[ -n $ok ]] || fail "the agent with a token did not report: $(cat "$E2E_TMP/pc01.json"); $(tail -n 5 "$AGENT_LOG")"
grep -q "WARN.*status report" "$AGENT_LOG" && fail "the agent with a token warned: $(grep WARN "$AGENT_LOG")"
log "ok: with VDSTREAM_TOKEN_FILE the agent reports again"
