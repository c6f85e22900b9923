#!/usr/bin/env bash
# `vdstream bench` against the served export: the VDI profile with --json gives total,
# read and write IOPS, MiB/s and latency percentiles that hang together (total = read +
# write, about 80% writes, p50 <= p99 <= max) and a time series, and its request count is
# the server's own (the requests the server recorded with --record-trace); --verify on a clean
# export checks reads and finds no mismatch; a smaller custom workload (sequential reads,
# 64 KiB) does what it says. Bad input gets a clear error: an unreachable socket, a URI
# without a scheme, a block size that is not a multiple of 512, and writes to a read-only
# export.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdinfo
e2e_init
[[ -x $VDSTREAM_BIN ]] || fail "$VDSTREAM_BIN not found: run 'cargo build --release' first"
bench() { run_bounded 60 "$VDSTREAM_BIN" bench "$@"; }

start_server --memory 256M --record-trace "$E2E_TMP/vdi.trace"
bench "$URI" --profile vdi --duration 2 --working-set 64M --json >"$E2E_TMP/vdi.json" || fail "bench --profile vdi failed"
"$PY" - "$E2E_TMP/vdi.json" <<'PYEOF' || fail "the VDI result does not hang together: $(cat "$E2E_TMP/vdi.json")"
import json, sys
j = json.load(open(sys.argv[1]))
w = j["workload"]
assert (w["workers"], w["queue_depth"], w["block_size"], w["write_pct"], w["random_pct"]) == (4, 16, 4096, 80, 90), w
t, r, wr = j["total"], j["read"], j["write"]
assert t["ops"] == r["ops"] + wr["ops"] and t["ops"] > 0, (t, r, wr)
assert r["iops"] > 0 and wr["iops"] > 0 and t["mib_per_sec"] > 0, j
assert 0.70 < wr["ops"] / t["ops"] < 0.90, ("write share", wr["ops"] / t["ops"])
assert abs(t["iops"] - r["iops"] - wr["iops"]) <= 0.5, (t, r, wr)
for f in (t, r, wr):
    l = f["latency"]
    assert 0 < l["p50_us"] <= l["p99_us"] <= l["max_us"] and l["mean_us"] > 0, l
assert j["working_set"] == 64 << 20 and j["export_size"] == 256 << 20, j
assert j["errors"] == 0 and j["verify"] is None, j
assert len(j["series"]) >= 1 and all(s["read_iops"] + s["write_iops"] > 0 for s in j["series"]), j["series"]
print(f"vdi: {t['iops']:.0f} IOPS ({r['iops']:.0f} read, {wr['iops']:.0f} write), mean {t['latency']['mean_us']} us, p99 {t['latency']['p99_us']} us, {len(j['series'])} intervals")
PYEOF
log "ok: the VDI profile's JSON hangs together"
stop_server
served=$(grep -o 'recorded [0-9]* requests' "$SERVER_LOG" | grep -o '[0-9]*') || fail "the server did not say how many requests it recorded: $(tail -n 3 "$SERVER_LOG")"
assert_eq "requests bench counted against requests the server served" "$(json_get "$E2E_TMP/vdi.json" 'j["total"]["ops"]')" "$served"
log "ok: bench counted the $served requests the server served"

start_server --memory 256M

bench "$URI" --duration 2 --working-set 8M --verify --json >"$E2E_TMP/verify.json" || fail "bench --verify failed on a clean export: $(cat "$E2E_TMP/verify.json")"
checked=$(json_get "$E2E_TMP/verify.json" 'j["verify"]["checked_reads"]')
assert_eq "verify mismatches on a clean export" "$(json_get "$E2E_TMP/verify.json" 'j["verify"]["mismatches"]')" 0
((checked > 0)) || fail "--verify checked no reads"
log "ok: --verify checked $checked reads"

bench "$URI" --duration 1 --workers 1 --queue-depth 2 --block-size 64K --write-pct 0 --random-pct 0 --json >"$E2E_TMP/seq.json" || fail "sequential reads failed"
"$PY" - "$E2E_TMP/seq.json" <<'PYEOF' || fail "sequential reads: $(cat "$E2E_TMP/seq.json")"
import json, sys
j = json.load(open(sys.argv[1]))
assert j["write"]["ops"] == 0 and j["read"]["ops"] > 0, j
assert j["read"]["bytes"] == j["read"]["ops"] * 65536, j
PYEOF
log "ok: a custom workload (1 worker, QD 2, 64 KiB sequential reads)"

# expect_error WHAT PATTERN ARGS... — bench ARGS fails with a message matching PATTERN.
expect_error() {
    local what=$1 pattern=$2 out rc=0; shift 2
    out=$(bench "$@" 2>&1) || rc=$?
    ((rc != 0)) || fail "$what: bench succeeded"
    [[ $out =~ $pattern ]] || fail "$what: unclear error: $out"
    log "ok: $what: $out"
}
expect_error "unreachable socket" "cannot benchmark.*$E2E_TMP/nosuch.sock.*listening" "nbd+unix:///?socket=$E2E_TMP/nosuch.sock" --duration 1
expect_error "URI without a scheme" "missing scheme.*nbd\+unix:///" "$E2E_TMP/nosuch.sock" --duration 1
expect_error "odd block size" "block size 1000 is not a multiple of 512" "$URI" --block-size 1000 --duration 1
stop_server

truncate -s 64M "$E2E_TMP/ro.img"
start_server "$E2E_TMP/ro.img" --read-only
expect_error "writes to a read-only export" "read-only.*--write-pct 0" "$URI" --duration 1
bench "$URI" --duration 1 --write-pct 0 --json >/dev/null || fail "reads of a read-only export failed"
log "ok: a read-only export is benchmarked with --write-pct 0"
