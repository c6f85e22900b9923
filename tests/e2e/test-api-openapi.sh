#!/usr/bin/env bash
# The server's OpenAPI document (`GET /api/v1/openapi.json`, generated from its typed
# handlers; docs/openapi.json is the same) is a valid OpenAPI 3.1 document
# (openapi-spec-validator) and a valid description of what the server answers:
# every route's JSON from a running server (the server, the vDisk list with a healthy and
# a damaged vDisk, a vDisk, its versions, a new version, promote, revert, targets, a target
# with its agent's report, set, remove, the agent's report itself, merge, the audit trail,
# an event of the live stream (a FarmEvent), the sessions with a live
# NBD session, an error) validates against the response schema of its route and status
# (openapi-schema-validator, OpenAPI 3.1), and each item of the vDisk list matches exactly
# one branch of the list's `oneOf`. scripts/test installs openapi-schema-validator and
# openapi-spec-validator with pip when they are missing.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
source "$(dirname "$0")/api-lib.sh"
require curl
require_vdstream
require_python_nbd
"$PY" -c 'import openapi_schema_validator, openapi_spec_validator' 2>/dev/null ||
    skip "python modules openapi_schema_validator and openapi_spec_validator are missing (scripts/test installs them with pip)"
e2e_init
store_init

vds vdisk create win --size 16M >/dev/null
vds vdisk create broken --size 16M >/dev/null
echo '{"name": "broken", "size": ' >"$STORE/vdisks/broken/vdisk.json" || fail "cannot damage a vDisk"
start_api
SPEC=$E2E_TMP/openapi.json
api GET /api/v1/openapi.json >"$SPEC.raw" || fail "GET /api/v1/openapi.json: curl failed"
[[ $(tail -n1 "$SPEC.raw") == 200 ]] || fail "GET /api/v1/openapi.json answered $(tail -n1 "$SPEC.raw")"
sed '$d' "$SPEC.raw" >"$SPEC"
"$PY" - "$SPEC" "$REPO_ROOT/docs/openapi.json" <<'PY' || fail "the served OpenAPI document"
import json, sys
from openapi_spec_validator import validate
served = json.load(open(sys.argv[1]))
validate(served)
assert served["openapi"].startswith("3.1"), served["openapi"]
assert served == json.load(open(sys.argv[2])), "docs/openapi.json is not the document the server serves"
PY
log "ok: the served document is valid OpenAPI 3.1 and docs/openapi.json is the same"

# The answers, saved as METHOD PATH STATUS FILE lines for the validator.
: >"$E2E_TMP/answers"
record() {
    local method=$1 path=$2 body=${3-} n
    n=$(wc -l <"$E2E_TMP/answers")
    api "$method" "$path" "$body" >"$E2E_TMP/a$n" || fail "$method $path: curl failed"
    printf '%s %s %s %s\n' "$method" "$path" "$(tail -n1 "$E2E_TMP/a$n")" "$E2E_TMP/a$n" >>"$E2E_TMP/answers"
    sed -i '$d' "$E2E_TMP/a$n"
}

record GET /api/v1/server
record GET /api/v1/vdisks
record GET /api/v1/vdisks/win
record POST /api/v1/vdisks/win/versions '{"note": "n"}'
record GET /api/v1/vdisks/win/versions
record POST /api/v1/vdisks/win/versions/1/promote '{"to": "test"}'
record POST /api/v1/vdisks/win/revert '{"version": 1}'
record POST /api/v1/targets '{"id": "vm1", "vdisk": "win", "cache": "server", "description": "rack 4", "macs": ["52-54-00-12-34-56"], "hostname": "rack4-vm1"}'
record GET /api/v1/targets
record PUT /api/v1/targets/vm1 '{"version": "test", "add_macs": ["52:54:00:12:34:57"], "overflow_device": "/dev/sda2"}'
record PUT /api/v1/targets/vm1/agent '{"target": "vm1", "pid": 1, "state": "running", "server": {"endpoint": "nbd://a/", "connected": true, "retries": 1, "reconnects": 0, "failovers": 0, "gave_up": 0}, "cache": {"used_percent": 3.5}}'
record GET /api/v1/targets/vm1
record GET /api/v1/vdisks/nope
record POST /api/v1/vdisks/win/merge '{}'
record POST /api/v1/vdisks/win/merge '{"base": 1}'
record GET '/api/v1/audit?vdisk=win&limit=3'
record GET '/api/v1/audit?limit=0'
# One event of the live stream: its data is a FarmEvent (the target vm1 with its report).
curl -sN --max-time 3 "$API_URL/api/v1/events" >"$E2E_TMP/events" || true
{ grep -m1 '^data: ' "$E2E_TMP/events" || true; } | sed 's/^data: //' >"$E2E_TMP/farm-event"
[[ -s $E2E_TMP/farm-event ]] || fail "GET /api/v1/events sent no event within 3 s: $(head -c 300 "$E2E_TMP/events")"
echo "EVENT /api/v1/events 200 $E2E_TMP/farm-event" >>"$E2E_TMP/answers"
# The sessions, while an NBD client holds one open.
"$PY" - "$API_NBD_SOCK" "$API_URL" "$E2E_TMP/sessions" <<'PY' || fail "cannot read the sessions while connected"
import nbd, sys, urllib.request
h = nbd.NBD()
h.set_export_name("vdisk/win")
h.connect_unix(sys.argv[1])
h.pread(4096, 0)
with urllib.request.urlopen(sys.argv[2] + "/api/v1/sessions", timeout=30) as r:
    open(sys.argv[3], "wb").write(r.read())
h.shutdown()
PY
echo "GET /api/v1/sessions 200 $E2E_TMP/sessions" >>"$E2E_TMP/answers"
record DELETE /api/v1/targets/vm1

"$PY" - "$SPEC" "$E2E_TMP/answers" <<'PY' || fail "an answer does not match the OpenAPI document"
import json, re, sys
from openapi_schema_validator import OAS31Validator

spec = json.load(open(sys.argv[1]))
components = spec["components"]

def resolve(node):
    while isinstance(node, dict) and "$ref" in node and node["$ref"].startswith("#/components/responses/"):
        node = components["responses"][node["$ref"].rsplit("/", 1)[1]]
    return node

def validator(schema):
    return OAS31Validator(dict(schema, components=components))

def schema_of(node):
    while "$ref" in node:
        node = components["schemas"][node["$ref"].rsplit("/", 1)[1]]
    return node

def route_of(path):
    path = path.split("?", 1)[0]
    for pattern in spec["paths"]:
        rx = "^" + re.sub(r"\{[^}]+\}", "[^/]+", pattern) + "$"
        if re.match(rx, path):
            return pattern
    raise SystemExit(f"{path}: no route in the spec")

failed = 0
for line in open(sys.argv[2]):
    method, path, status, file = line.split()
    doc = json.load(open(file))
    if method == "EVENT":
        errors = list(validator(components["schemas"]["FarmEvent"]).iter_errors(doc))
        for e in errors:
            print(f"FAIL an event of {path}: {e.message[:300]} at {list(e.absolute_path)}", file=sys.stderr)
        if not errors and not any(t.get("agent", {}).get("pid") == 1 for t in doc["targets"]):
            print(f"FAIL the event of {path} does not carry vm1's report: {doc['targets']}", file=sys.stderr)
            errors = [1]
        failed += bool(errors)
        if not errors:
            print(f"ok: an event of {path} matches FarmEvent", file=sys.stderr)
        continue
    op = spec["paths"][route_of(path)][method.lower()]
    resp = resolve(op["responses"].get(status))
    if resp is None:
        print(f"FAIL {method} {path}: status {status} is not documented", file=sys.stderr)
        failed += 1
        continue
    schema = resp["content"]["application/json"]["schema"]
    errors = list(validator(schema).iter_errors(doc))
    for e in errors:
        print(f"FAIL {method} {path} {status}: {e.message[:300]} at {list(e.absolute_path)}", file=sys.stderr)
    failed += bool(errors)
    if not errors:
        print(f"ok: {method} {path} {status} matches its schema", file=sys.stderr)
    if method == "GET" and path == "/api/v1/vdisks":
        branches = schema_of(schema["items"])["oneOf"]
        kinds = set()
        before = failed
        for item in doc:
            matching = [i for i, b in enumerate(branches) if validator(b).is_valid(item)]
            if len(matching) != 1:
                print(f"FAIL vdisk list item {item.get('name')}: matches oneOf branches {matching}, not exactly one", file=sys.stderr)
                failed += 1
            kinds.update(matching)
        if failed > before:
            pass
        elif kinds != set(range(len(branches))):
            print(f"FAIL the vdisk list shows only branches {kinds}: the test needs a healthy and a damaged vDisk", file=sys.stderr)
            failed += 1
        else:
            print("ok: each vDisk list item matches exactly one oneOf branch", file=sys.stderr)
sys.exit(1 if failed else 0)
PY
log "ok: the OpenAPI document describes every answer"
