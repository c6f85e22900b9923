#!/usr/bin/env bash
# `vdstream bench --verify` catches a real corruption. Against nbdkit's memory plugin (a
# peer) and vdstream's own RAM disk: bench writes stamped blocks into a 1 MiB working set
# and checks every read against the last acknowledged write; in the middle of the run
# nbdsh, on a second connection, overwrites the whole working set behind its back. bench
# must exit non-zero, report mismatches in its JSON with offsets inside the working set
# and "not a stamp" (the 0xa5 bytes nbdsh wrote), and name the first offset in its error.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdkit nbdsh
require_python_nbd
require_vdstream
e2e_init

for peer in nbdkit vdstream; do
    sock=$E2E_TMP/$peer.sock
    uri="nbd+unix:///?socket=$sock"
    case $peer in
    nbdkit) nbdkit -f -U "$sock" memory 64M >"$E2E_TMP/$peer.log" 2>&1 </dev/null & ;;
    vdstream) "$VDSTREAM_BIN" serve-image --memory 64M --socket "$sock" >"$E2E_TMP/$peer.log" 2>&1 </dev/null & ;;
    esac
    pid=$!
    track_pid "$pid"
    wait_ready "$pid" "$uri"

    run_bounded 60 "$VDSTREAM_BIN" bench "$uri" --verify --working-set 1M --write-pct 50 --duration 4 --json \
        >"$E2E_TMP/$peer.json" 2>"$E2E_TMP/$peer.err" &
    bench_pid=$!
    sleep 1.5
    timeout 30 nbdsh -u "$uri" -c 'h.pwrite(b"\xa5" * (1 << 20), 0)' || fail "$peer: nbdsh could not write"
    log "$peer: nbdsh overwrote the working set"
    rc=0
    wait "$bench_pid" || rc=$?
    ((rc == 1)) || fail "$peer: bench exited $rc after a corruption (want 1): $(cat "$E2E_TMP/$peer.err")"
    "$PY" - "$E2E_TMP/$peer.json" <<'PYEOF' || fail "$peer: the corruption is not reported: $(cat "$E2E_TMP/$peer.json")"
import json, sys
v = json.load(open(sys.argv[1]))["verify"]
assert v["mismatches"] > 0 and v["first"], v
for m in v["first"]:
    assert 0 <= m["offset"] < 1 << 20 and m["expected_generation"] >= 1, m
assert any("not a stamp (bytes a5a5" in m["found"] for m in v["first"]), v["first"]
print(f"{v['mismatches']} mismatches in {v['checked_reads']} checked reads; first: {v['first'][0]}")
PYEOF
    grep -Eq "verify mismatches, the first at offset [0-9]+" "$E2E_TMP/$peer.err" ||
        fail "$peer: the error does not name the offset: $(cat "$E2E_TMP/$peer.err")"
    log "ok: $peer: $(tail -n1 "$E2E_TMP/$peer.err")"
    stop_server "$pid" 10 || true
done
