#!/usr/bin/env bash
# `vdstream demo --quick --json`: the README's first command, end to end (store, server,
# one agent per cache type, the VDI profile on each). Every row of the table is there
# with non-zero IOPS, read and write IOPS and latency and a measured noise; ram-overflow
# that fits in RAM sends less I/O to storage per target than device-disk (the point of a
# RAM cache); the raw disk row is unbuffered (O_DIRECT); the RAM cache that fits runs
# a second time through the agent's vhost-user-blk backend; the headline compares
# ram-overflow with the raw disk, in the figures of those rows; the demo
# stops every process it started and removes its scratch folder. A second run is
# interrupted with SIGINT while it works: it exits 130 and still cleans up.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdinfo
require_vdstream
e2e_init
export TMPDIR=$E2E_TMP/tmp
mkdir -p "$TMPDIR"

run_bounded 240 "$VDSTREAM_BIN" demo --quick --json --report "$E2E_TMP/report" >"$E2E_TMP/demo.json" 2>"$E2E_TMP/demo.err" ||
    fail "vdstream demo --quick failed: $(cat "$E2E_TMP/demo.err")"
"$PY" - "$E2E_TMP/demo.json" <<'PYEOF' || fail "the demo's table: $(cat "$E2E_TMP/demo.json")"
import json, sys
j = json.load(open(sys.argv[1]))
rows = {r["name"]: r for r in j["rows"]}
want = ["raw disk", "ram-overflow (fits)", "ram-overflow (fits), vhost-user-blk", "ram-overflow (overflows)", "device-ram", "device-disk", "server"]
assert list(rows) == want, list(rows)
for name, r in rows.items():
    b = r["result"]
    assert b["total"]["iops"] > 0 and b["read"]["iops"] > 0 and b["write"]["iops"] > 0, (name, b["total"])
    assert b["total"]["latency"]["mean_us"] > 0 and b["errors"] == 0, (name, b)
    assert r["storage_ops"] > 0 and r["storage_iops"] > 0, (name, r["storage_iops"])
    print(f"{name:24} {b['total']['iops']:>9.0f} IOPS  storage {r['storage_iops']:>9.0f} IOPS  {r['storage_reduction_pct']}")
fits, disk = rows["ram-overflow (fits)"], rows["device-disk"]
assert fits["storage_iops"] < disk["storage_iops"], (fits["storage_iops"], disk["storage_iops"])
assert fits["storage_reduction_pct"] > 0 and disk["storage_reduction_pct"] == 0, (fits["storage_reduction_pct"], disk["storage_reduction_pct"])
# The raw disk is the disk: unbuffered where the folder's file system allows it (it does
# here: TMPDIR is on the test's own disk), and the row says which.
raw = rows["raw disk"]
assert "serve-image FILE --direct" in raw["setup"], raw["setup"]
# The headline is the field reports' comparison, RAM+overflow against the raw disk, with
# the figures of those two rows; each row's IOPS carry a measured noise.
ratio = fits["result"]["total"]["iops"] / raw["result"]["total"]["iops"]
assert j["headline"].startswith(f"ram-overflow (fits): {ratio:.1f}x the IOPS of the raw disk"), (j["headline"], ratio)
# The same RAM cache through the agent's vhost-user-blk backend: a real vhost-user
# frontend's virtqueues, not the NBD socket; the headline gives its ratio too.
vhost = rows["ram-overflow (fits), vhost-user-blk"]
assert vhost["result"]["uri"].startswith("vhost-user:") and "--vhost-user SOCKET" in vhost["setup"], vhost["setup"]
vratio = vhost["result"]["total"]["iops"] / raw["result"]["total"]["iops"]
assert f"; through vhost-user-blk, {vratio:.1f}x (" in j["headline"], (j["headline"], vratio)
for name, r in rows.items():
    assert r["iops_noise_pct"] is not None and r["iops_noise_pct"] >= 0, (name, r["iops_noise_pct"])
PYEOF
log "ok: every row measured; ram-overflow's storage IOPS per target is below device-disk's; the raw disk is unbuffered; the headline compares ram-overflow with it"

# The report: Markdown that shows four charts, each rendered by a real SVG renderer.
for chart in iops-per-cache-type storage-iops-per-target iops-over-time latency-over-time; do
    grep -q "($chart.svg)" "$E2E_TMP/report/report.md" || fail "report.md does not show $chart.svg"
done
grep -q "| ram-overflow (overflows) |" "$E2E_TMP/report/report.md" || fail "report.md has no table"
json_get "$E2E_TMP/report/result.json" 'len(j["rows"])' >/dev/null || fail "the report's result.json does not parse"
rasterize_charts "$E2E_TMP/report"
assert_demo_gone "the demo"
log "ok: no scratch folder and no process left"

# Interrupted in the middle: SIGINT once the first agent row is running.
"$VDSTREAM_BIN" demo --quick --duration 5 >"$E2E_TMP/int.out" 2>"$E2E_TMP/int.err" &
demo_pid=$!
track_pid "$demo_pid"
for _ in $(seq 300); do
    compgen -G "$TMPDIR/vdstream-demo-*/ram-overflow.log" >/dev/null && break
    sleep 0.1
done
sleep 1
kill -INT "$demo_pid"
rc=0
for _ in $(seq 150); do kill -0 "$demo_pid" 2>/dev/null || break; sleep 0.1; done
wait "$demo_pid" || rc=$?
assert_eq "exit status after SIGINT" "$rc" 130
sleep 0.5
assert_demo_gone "the interrupted demo"
log "ok: SIGINT stops the demo's servers and agents and removes its folder"
