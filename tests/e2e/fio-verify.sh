# shellcheck shell=bash
# fio-verify.sh — sourced by the fio tests: run_fio_verify NAME FIO-ARGS...
# Runs fio's nbd engine against $URI with --output-format=json+normal, requires exit
# status 0, no verify errors in the output, every job error field 0, and some I/O done.
run_fio_verify() {
    local name=$1; shift
    local out=$E2E_TMP/fio-$name.out json=$E2E_TMP/fio-$name.json rc=0
    log "fio $name: $*"
    run_bounded 300 fio --name="$name" --ioengine=nbd --uri="$URI" \
        --verify=crc32c --verify_fatal=1 --do_verify=1 --verify_state_save=0 \
        --output-format=json --output="$json" "$@" >"$out" 2>&1 || rc=$?
    cat "$out" >&2
    [[ $rc -eq 0 ]] || { tail -n 40 "$json" >&2; fail "fio $name exited $rc"; }
    if grep -Eiq 'verify: bad|bad magic|crc32c:? mismatch|verify failed' "$out" "$json"; then
        fail "fio $name reported verify errors"
    fi
    "$PY" - "$json" <<'PYEOF' || fail "fio $name: job errors or no I/O"
import json, sys
text = open(sys.argv[1]).read()
j = json.loads(text[text.index('{'):])          # fio may print notes before the JSON
for job in j["jobs"]:
    assert job["error"] == 0, f"job {job['jobname']} error {job['error']}"
    w, r = job["write"]["io_bytes"], job["read"]["io_bytes"]
    assert w > 0 and r > 0, f"job {job['jobname']} wrote {w} and read {r} bytes"
    print(f"fio {job['jobname']}: wrote {w >> 20} MiB, read/verified {r >> 20} MiB, "
          f"write iops {job['write']['iops']:.0f}")
PYEOF
}
