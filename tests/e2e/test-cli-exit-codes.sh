#!/usr/bin/env bash
# Exit statuses and --json errors (docs/ADMIN.md, "Scripts"; `vdstream --help`): each class of
# failure exits with its own status, and with --json prints one JSON object on stdout,
# {"error": {"kind", "status", "message"}}, besides the message on stderr:
#   2 usage        bad name, unknown subcommand, bad size, nothing to set
#   3 not_found    unknown vDisk (store and API 404), no store, unknown target
#   4 conflict     a second maintenance version (store and API 409)
#   5 io           export into a missing folder; damaged metadata
#   6 unavailable  an API nobody answers on; `target status` of a stopped agent
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=api-lib.sh
source "$E2E_DIR/api-lib.sh"
# shellcheck source=agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
require nbdinfo curl
require_vdstream
e2e_init
store_init
V=$VDSTREAM_BIN

# expect STATUS KIND PATTERN ARGS... — `vdstream ARGS` exits STATUS with PATTERN on stderr;
# `vdstream ARGS --json` exits STATUS too, and its stdout is exactly one error object of KIND.
expect() {
    local want=$1 kind=$2 pattern=$3 rc=0; shift 3
    timeout 60 "$V" "$@" >"$E2E_TMP/out.txt" 2>"$E2E_TMP/err.txt" || rc=$?
    [[ $rc == "$want" ]] || fail "vdstream $*: status $rc, want $want ($kind): $(cat "$E2E_TMP/err.txt")"
    grep -Eq -- "$pattern" "$E2E_TMP/err.txt" || fail "vdstream $*: stderr lacks /$pattern/: $(cat "$E2E_TMP/err.txt")"
    rc=0
    timeout 60 "$V" "$@" --json >"$E2E_TMP/out.json" 2>"$E2E_TMP/err.txt" || rc=$?
    [[ $rc == "$want" ]] || fail "vdstream $* --json: status $rc, want $want"
    "$PY" - "$E2E_TMP/out.json" "$kind" "$want" "$pattern" <<'PYEOF' || fail "vdstream $* --json: stdout is not the error object: $(cat "$E2E_TMP/out.json")"
import json, re, sys
path, kind, status, pattern = sys.argv[1:]
doc = json.load(open(path))  # one JSON document, nothing else
assert set(doc) == {"error"}, doc
e = doc["error"]
assert set(e) == {"kind", "status", "message"}, e
assert e["kind"] == kind and e["status"] == int(status), e
assert re.search(pattern, e["message"]), e
PYEOF
    log "ok: status $want ($kind): vdstream ${*:1:4}"
}

vds vdisk create w --size 1M >/dev/null

expect 2 usage "invalid vDisk name" vdisk info 'bad name' --store "$STORE"
expect 2 usage "unrecognized subcommand" vdisk lst --store "$STORE"
expect 2 usage "unknown unit" vdisk create x --size 12parsecs --store "$STORE"
expect 2 usage "nothing to set" vdisk set w --store "$STORE"
expect 3 not_found 'no vDisk named "nope"' vdisk info nope --store "$STORE"
expect 3 not_found "no store at" vdisk list --store "$E2E_TMP/no-store"
expect 3 not_found 'no target named "vm9"' target show vm9 --store "$STORE"
vds version new w >/dev/null
expect 4 conflict "already has version 1 in maintenance" version new w --store "$STORE"
expect 5 io "cannot create .*missing/x.raw" vdisk export w "$E2E_TMP/missing/x.raw" --store "$STORE"
expect 6 unavailable "cannot connect .*127.0.0.1:1" vdisk list --server http://127.0.0.1:1

# The same classes through a server's API: 404 and 409.
start_api
expect 3 not_found 'no vDisk named "nope"' vdisk info nope --server "$API_URL"
expect 4 conflict "already has version 1 in maintenance" version new w --server "$API_URL"

# Damaged metadata: an I/O-class failure, named.
cp "$STORE/vdisks/w/vdisk.json" "$E2E_TMP/vdisk.json"
echo '{ not json' >"$STORE/vdisks/w/vdisk.json"
expect 5 io "vdisk.json is corrupt" vdisk info w --store "$STORE"
cp "$E2E_TMP/vdisk.json" "$STORE/vdisks/w/vdisk.json"

# `target status` of an agent that stopped: its last figures, and status 6. With --json
# stdout holds the status document alone (state "stopped"), not an error object after it.
start_server --memory 4M
start_agent t1 --server "$URI" --cache device-ram --ram 4M
"$V" target status t1 >/dev/null || fail "target status of a running agent failed"
stop_server "$AGENT_PID" 20 || fail "the agent did not stop on SIGTERM"
rc=0
"$V" target status t1 >"$E2E_TMP/st.txt" 2>"$E2E_TMP/st.err" || rc=$?
assert_eq "target status of a stopped agent: status" "$rc" 6
grep -q "has no running agent" "$E2E_TMP/st.err" || fail "no message: $(cat "$E2E_TMP/st.err")"
grep -q "^target t1: stopped" "$E2E_TMP/st.txt" || fail "the last figures are not shown: $(cat "$E2E_TMP/st.txt")"
rc=0
"$V" target status t1 --json >"$E2E_TMP/st.json" 2>/dev/null || rc=$?
assert_eq "target status --json of a stopped agent: status" "$rc" 6
assert_eq "its document's state" "$(json_get "$E2E_TMP/st.json" 'j["state"]')" stopped
log "ok: every class has its status and its JSON error"
