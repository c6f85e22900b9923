#!/usr/bin/env bash
# --server http:// without a target record: a clear error naming the target and
# `vdstream target add`; with --vdisk NAME --cache TYPE the agent runs without one, its
# reports refused by the API until the record is added; NBD URIs and http:// URLs do not mix.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=server-lib.sh
source "$E2E_DIR/server-lib.sh"
# shellcheck source=agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
# shellcheck source=api-lib.sh
source "$E2E_DIR/api-lib.sh"
require nbdinfo curl
require_vdstream
e2e_init
store_init

golden_vdisk w 16
start_store_server --name a --http 127.0.0.1:0
server_api_url "$SERVER_LOG" "$SERVER_PID"
agent_env

rc=0
run_bounded 30 "$VDSTREAM_BIN" target attach ghost --server "$API_URL" >"$E2E_TMP/ghost.out" 2>&1 || rc=$?
cat "$E2E_TMP/ghost.out" >&2
[[ $rc -ne 0 ]] || fail "attach of a target without a record succeeded"
grep -q 'target ghost has no record' "$E2E_TMP/ghost.out" || fail "the error does not say the record is missing"
grep -q 'vdstream target add ghost' "$E2E_TMP/ghost.out" || fail "the error does not say how to add the record"
[[ ! -e $VDSTREAM_RUN_DIR/ghost.sock ]] || fail "a socket was left behind"

rc=0
run_bounded 30 "$VDSTREAM_BIN" target attach mix --server "$API_URL" --server "$(xuri vdisk/w)" >"$E2E_TMP/mix.out" 2>&1 || rc=$?
if [[ $rc -eq 0 ]] || ! grep -q 'every --server' "$E2E_TMP/mix.out"; then
    fail "mixed servers were not refused clearly: $(cat "$E2E_TMP/mix.out")"
fi

start_agent lab1 --server "$API_URL" --vdisk w --cache device-ram --ram 8M
assert_eq "export" "$(agent_status_get lab1 'j["vdisk"]["export"]')" vdisk/w
assert_eq "size" "$(nbdinfo --size "$URI")" $((16 << 20))
# Its reports are refused while it has no record (the API keeps reports only of targets
# in the store), and accepted once the record is added.
ok=
for ((i = 0; i < 100; i++)); do
    if grep -q 'refused an agent report for target "lab1"' "$SERVER_LOG"; then
        ok=1
        break
    fi
    sleep 0.2
done
[[ -n $ok ]] || fail "the server did not log refusing lab1's report"
! api GET /metrics | grep -q 'vdstream_agent_connected{target="lab1"}' || fail "the API keeps a report of lab1, which has no record"
vds target add lab1 --vdisk w --cache device-ram --ram 8M >/dev/null
ok=
for ((i = 0; i < 100; i++)); do
    if api GET /metrics | grep -q '^vdstream_agent_connected{target="lab1"} 1'; then
        ok=1
        break
    fi
    sleep 0.2
done
[[ -n $ok ]] || fail "the API has no report of lab1 after its record was added: $(api GET /metrics | grep vdstream_agent)"
log "ok: lab1 runs without a record; its reports count once the record exists"
rc=0
stop_server "$AGENT_PID" 15 || rc=$?
assert_eq "agent exit status" "$rc" 0
