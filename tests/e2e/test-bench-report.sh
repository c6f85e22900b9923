#!/usr/bin/env bash
# `vdstream bench --report DIR`: a Markdown report that shows its two charts (IOPS and
# latency over time), the run's figures, and result.json beside it; rsvg-convert renders
# both charts to PNG.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdinfo
require_vdstream
e2e_init

start_server --memory 128M
run_bounded 60 "$VDSTREAM_BIN" bench "$URI" --duration 3 --working-set 32M --report "$E2E_TMP/report" >"$E2E_TMP/out.txt" ||
    fail "bench --report failed"
grep -q "report: $E2E_TMP/report/report.md" "$E2E_TMP/out.txt" || fail "bench does not say where the report is: $(cat "$E2E_TMP/out.txt")"
for chart in iops-over-time latency-over-time; do
    grep -q "($chart.svg)" "$E2E_TMP/report/report.md" || fail "report.md does not show $chart.svg"
done
iops=$(json_get "$E2E_TMP/report/result.json" 'round(j["total"]["iops"])')
((iops > 0)) || fail "result.json has no IOPS"
grep -q "| this run | $iops |" "$E2E_TMP/report/report.md" || fail "report.md does not carry the run's $iops IOPS: $(cat "$E2E_TMP/report/report.md")"
log "ok: report.md, result.json ($iops IOPS) and two charts"
rasterize_charts "$E2E_TMP/report"
