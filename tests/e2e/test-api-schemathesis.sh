#!/usr/bin/env bash
# schemathesis (`st run --checks all`: its examples, coverage, fuzzing and stateful phases)
# against a live server and the document it serves (`GET /api/v1/openapi.json`, generated
# from its typed handlers; docs/openapi.json is the same) finds no failure: no schema-valid request is
# refused, no schema-invalid one accepted, no answer, header or live event outside its
# schema, no 5xx. A fixed seed makes a failure repeatable (`st replay`, or the seed in the
# log). The store holds a vDisk with a maintenance version and a target, so that the
# routes that need them have them; the API is open (loopback, no token yet), so every
# route is reached rather than answered 401. scripts/test installs schemathesis with pip;
# schemathesis.toml says which answers a schema-valid request may get.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
source "$(dirname "$0")/api-lib.sh"
require curl
require_vdstream
"$PY" -c 'import schemathesis' 2>/dev/null || fail "the Python module schemathesis is missing (scripts/test installs it with pip)"
e2e_init
store_init

vds vdisk create win --size 16M >/dev/null
vds version new win >/dev/null
vds target add vm1 --vdisk win --cache server >/dev/null
start_api

# The document as the server serves it.
curl -sSf --max-time 30 -o "$E2E_TMP/openapi.json" "$API_URL/api/v1/openapi.json" || fail "GET /api/v1/openapi.json failed"

# In the temporary folder: schemathesis keeps its example database and reports in the
# working directory.
rc=0
(cd "$E2E_TMP" && timeout 600 "$PY" -m schemathesis.cli --config-file "$E2E_DIR/schemathesis.toml" run "$E2E_TMP/openapi.json" --url "$API_URL" \
    --checks all --workers 1 --request-timeout 10 --seed 20261128 --no-color) >"$E2E_TMP/st.out" 2>&1 || rc=$?
grep -E '^ *(Selected|Tested):|generated, ' "$E2E_TMP/st.out" | sed 's/^ */schemathesis: /' >&2 || true
if ((rc != 0)); then
    # Each failure as schemathesis tells it (its check, the answer, the curl to replay it).
    sed -n '/^=* *FAILURES/,$p' "$E2E_TMP/st.out" | head -n 200 >&2
    fail "schemathesis found failures (status $rc; its whole output: $E2E_TMP/st.out, kept in target/test-logs on failure)"
fi
grep -q "No issues found\|passed" "$E2E_TMP/st.out" || fail "schemathesis said neither 'No issues found' nor 'passed': $(tail -n 20 "$E2E_TMP/st.out")"
log "ok: schemathesis --checks all finds nothing against the generated document"
