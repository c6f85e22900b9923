#!/usr/bin/env bash
# `vdstream demo --quick --boot`: the demo's boot storm, as a user runs it from anywhere
# (not in the checkout). The binary builds the golden image from its embedded scripts into
# a fresh cache folder ($XDG_CACHE_HOME/vdstream/golden; the Debian packages come from
# target/golden-cache, so nothing is downloaded again), then after the cache table boots a
# local-file peer and VDSTREAM_VM_STORM guests (default 3) at once, each through its own
# ram-overflow agent. Checks what a user looks at: every guest booted, every boot time is
# there and positive, the store was read less than N times one target's reads (the shared
# read cache), the report's boot chart rasterizes, nothing is left behind.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=vm-lib.sh
source "$E2E_DIR/vm-lib.sh"
require_vdstream
e2e_init
require_vm # builds target/golden-image once: fills the package cache the binary's build uses
N=${VDSTREAM_VM_STORM:-3}
VDSTREAM_VM_ACCEL=$(vm_accel)
export VDSTREAM_VM_ACCEL
export XDG_CACHE_HOME=$E2E_TMP/xdg VDSTREAM_GOLDEN_CACHE=$REPO_ROOT/target/golden-cache
export TMPDIR=$E2E_TMP/tmp
mkdir -p "$TMPDIR"

start=$SECONDS
(cd / && run_bounded 240 "$VDSTREAM_BIN" demo --quick --duration 1 --boot --boot-targets "$N" --json --report "$E2E_TMP/report") \
    >"$E2E_TMP/demo.json" 2>"$E2E_TMP/demo.err" || fail "vdstream demo --quick --boot failed: $(cat "$E2E_TMP/demo.err")"
log "demo --quick --duration 1 --boot --boot-targets $N: $((SECONDS - start)) s"
"$PY" - "$E2E_TMP/demo.json" "$N" "$XDG_CACHE_HOME" <<'PYEOF' || fail "the demo's boot storm: $(cat "$E2E_TMP/demo.json")"
import json, sys
j = json.load(open(sys.argv[1]))
n = int(sys.argv[2])
assert len(j["rows"]) == 7, [r["name"] for r in j["rows"]]  # the cache table ran first (7 rows: raw disk, 5 cache types, ram-overflow over vhost-user-blk)
b = j["boot"]
assert b["golden"].startswith(sys.argv[3] + "/vdstream/golden"), b["golden"]
assert b["targets"] == n and len(b["guests"]) == n, (b["targets"], len(b["guests"]))
assert b["failures"] == 0, [g["problem"] for g in b["guests"]]
for g in b["guests"] + [b["local_file"]]:
    assert g["ok"] and g["problem"] is None, g
    assert g["boot_secs"] > 0 and g["run_secs"] >= g["boot_secs"], g
for g in b["guests"]:
    assert g["guest_read_bytes"] > 0 and g["from_server_bytes"] > 0, g
s = b["boot_secs"]
assert 0 < s["min"] <= s["median"] <= s["max"], s
assert s["min"] == min(g["boot_secs"] for g in b["guests"]) and s["max"] == max(g["boot_secs"] for g in b["guests"]), s
one, store = b["one_target_read_bytes"], b["store_read_bytes"]
assert one == max(g["from_server_bytes"] for g in b["guests"]), b
assert 0 < store < n * one, f"store reads {store} are not below {n} x one target's {one}: the read cache did not share"
print(f"local file {b['local_file']['boot_secs']} s; {n} guests: boot s min {s['min']}, median {s['median']}, max {s['max']}; "
      f"store reads {store >> 10} KiB = {store / one:.2f}x one target's ({one >> 10} KiB)")
PYEOF
log "ok: $N guests booted at once through the demo's server; the store was read less than $N x one target's reads"

[[ -f $XDG_CACHE_HOME/vdstream/golden/image/golden.img ]] || fail "no golden image in the cache folder"
grep -q '(boot-times.svg)' "$E2E_TMP/report/report.md" || fail "report.md does not show boot-times.svg"
grep -q '| storm through vdstream |' "$E2E_TMP/report/report.md" || fail "report.md has no boot storm table"
json_get "$E2E_TMP/report/result.json" 'j["boot"]["targets"]' >/dev/null || fail "the report's result.json has no boot storm"
rasterize_charts "$E2E_TMP/report"

assert_demo_gone "the demo"
log "ok: no scratch folder, agent or guest left"
