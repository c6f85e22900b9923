#!/usr/bin/env bash
# RAM sizing from a recorded trace. An agent (ram-overflow over a read-only serve-image)
# records with --record-trace while fio's nbd engine runs a small random read/write job;
# the trace must hold exactly the reads and writes fio says it issued. `vdstream size`
# replays it at three RAM sizes: ram-overflow's storage writes fall as RAM grows,
# device-ram refuses writes (ENOSPC) at the smallest size and not at the largest, and with
# --target-storage-iops the recommendation is the smallest RAM whose storage IOPS meet it.
# serve-image --memory --record-trace under nbdsh records trims, zeroes and flushes too, and a cut
# trace is refused naming the file and the byte offset. The chart renders (rsvg-convert).
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
require fio nbdinfo
require_python_nbd
require_vdstream
e2e_init

base=$E2E_TMP/base.img
make_sparse_image "$base" 64
start_server "$base" --read-only
srv_uri=$URI

# ---- 1. the agent records what fio issues
trace=$E2E_TMP/vm1.trace
start_agent vm1 --server "$srv_uri" --cache ram-overflow --ram 8M --record-trace "$trace"
fio_json=$E2E_TMP/fio.json
run_bounded 120 fio --name=sizing --ioengine=nbd --uri="$URI" --rw=randrw --rwmixwrite=70 \
    --bs=4k --size=24m --number_ios=3000 --iodepth=8 --randrepeat=1 \
    --output-format=json --output="$fio_json" >/dev/null || fail "fio exited non-zero"
read -r fio_reads fio_writes < <("$PY" - "$fio_json" <<'PYEOF'
import json, sys
text = open(sys.argv[1]).read()
j = json.loads(text[text.index('{'):])
job = j["jobs"][0]
assert job["error"] == 0, job["error"]
print(job["read"]["total_ios"], job["write"]["total_ios"])
PYEOF
)
log "fio issued $fio_reads reads and $fio_writes writes"
((fio_writes > 1000)) || fail "fio issued too few writes ($fio_writes) to size anything"
rc=0
stop_server "$AGENT_PID" 15 || rc=$?
assert_eq "agent exit status" "$rc" 0
grep -q "recorded $((fio_reads + fio_writes)) requests in $trace" "$AGENT_LOG" ||
    fail "the agent did not report $((fio_reads + fio_writes)) recorded requests: $(grep -i record "$AGENT_LOG")"

# ---- 2. size: counts, the fall of storage writes, ENOSPC
out=$E2E_TMP/size.json
run_bounded 120 "$VDSTREAM_BIN" size --trace "$trace" --ram 1M,8M,64M --json >"$out" || fail "vdstream size failed"
assert_eq "trace reads" "$(json_get "$out" 'j["trace"]["requests"]["read"]')" "$fio_reads"
assert_eq "trace writes" "$(json_get "$out" 'j["trace"]["requests"]["write"]')" "$fio_writes"
assert_eq "trace trims+zeroes+flushes" "$(json_get "$out" 'sum(j["trace"]["requests"][k] for k in ("trim","zero","flush"))')" 0
assert_eq "traced device size" "$(json_get "$out" 'j["trace"]["device_size"]')" $((64 << 20))
"$PY" - "$out" <<'PYEOF' || fail "size results are not as a user expects (above)"
import json, sys
j = json.load(open(sys.argv[1]))
rows = j["results"]
ro = sorted((r for r in rows if r["cache"] == "ram-overflow"), key=lambda r: r["ram_bytes"])
dr = sorted((r for r in rows if r["cache"] == "device-ram"), key=lambda r: r["ram_bytes"])
dd = [r for r in rows if r["cache"] == "device-disk"]
assert [r["ram_bytes"] for r in ro] == [1 << 20, 8 << 20, 64 << 20], ro
assert len(dd) == 1 and dd[0]["ram_bytes"] is None, dd
w = [r["storage_write_ops"] for r in ro]
print("ram-overflow storage writes at 1M, 8M, 64M:", w, "; device-disk:", dd[0]["storage_write_ops"])
assert w[0] >= w[1] >= w[2] and w[0] > w[2], f"storage writes do not fall as RAM grows: {w}"
assert w[2] == 0, f"24 MiB of writes fit in 64 MiB of RAM, yet {w[2]} reached storage"
assert ro[0]["peak_file_bytes"] > 0 and ro[2]["peak_file_bytes"] == 0, ro
assert dd[0]["cache_file_write_ops"] > 0, dd
assert dr[0]["enospc"] and dr[0]["enospc"]["refused_writes"] > 0, f"device-ram 1M: no ENOSPC: {dr[0]}"
assert dr[2]["enospc"] is None, f"device-ram 64M refused writes: {dr[2]}"
for r in rows:
    assert r["errors"] == 0, r
PYEOF

# ---- 3. the recommendation with a target: between the smallest and the largest RAM's rates
target=$(json_get "$out" '(sorted((r for r in j["results"] if r["cache"]=="ram-overflow"), key=lambda r: r["ram_bytes"])[0]["storage_iops"]) / 2')
chart=$E2E_TMP/ram.svg
run_bounded 120 "$VDSTREAM_BIN" size --trace "$trace" --ram 1M,8M,64M --cache ram-overflow,device-ram \
    --target-storage-iops "$target" --json --chart "$chart" >"$out" || fail "vdstream size --target-storage-iops failed"
"$PY" - "$out" "$target" <<'PYEOF' || fail "the recommendation is not the smallest RAM meeting the target"
import json, sys
j = json.load(open(sys.argv[1])); target = float(sys.argv[2])
assert j["goal"]["storage_iops_max"] == target
for kind in ("ram-overflow", "device-ram"):
    rows = sorted((r for r in j["results"] if r["cache"] == kind), key=lambda r: r["ram_bytes"])
    ok = [r["ram_bytes"] for r in rows if r["storage_iops"] <= target and r["enospc"] is None]
    got = [a["ram_bytes"] for a in j["recommendations"] if a["cache"] == kind]
    print(kind, "target", target, "rates", [round(r["storage_iops"], 1) for r in rows], "recommended", got)
    assert got == [ok[0] if ok else None], (kind, got, ok)
    assert got[0] is not None and got[0] > rows[0]["ram_bytes"], f"{kind}: the smallest RAM cannot meet half its own rate"
PYEOF
grep -q '<svg' "$chart" || fail "no chart written"
if command -v rsvg-convert >/dev/null; then
    rsvg-convert -o "$E2E_TMP/ram.png" "$chart" || fail "rsvg-convert refused the chart"
    log "ok: the chart renders"
fi
"$VDSTREAM_BIN" size --trace "$trace" --ram 1M,8M,64M --target-storage-iops "$target" >"$E2E_TMP/size.txt" ||
    fail "vdstream size (table) failed"
cat "$E2E_TMP/size.txt" >&2
grep -q "^recommended: ram-overflow with --ram " "$E2E_TMP/size.txt" || fail "the table gives no ram-overflow recommendation"

# ---- 4. serve-image --record-trace: every operation, counted exactly
trace2=$E2E_TMP/img.trace
start_server --memory 64M --record-trace "$trace2"
nbdsh_script '
for i in range(3):
    h.pread(4096, i * 65536)
h.pwrite(b"x" * 8192, 1 << 20)
h.pwrite(b"y" * 512, 3 << 20)
h.trim(65536, 2 << 20)
h.zero(4096, 5 << 20)
h.flush()
' || fail "nbdsh failed"
rc=0
stop_server "$SERVER_PID" 15 || rc=$?
assert_eq "serve-image exit status" "$rc" 0
run_bounded 60 "$VDSTREAM_BIN" size --trace "$trace2" --ram 1M --json >"$out" || fail "vdstream size on the serve-image trace failed"
assert_eq "nbdsh requests by op" "$(json_get "$out" '[j["trace"]["requests"][k] for k in ("read","write","trim","zero","flush")]')" "[3, 2, 1, 1, 1]"

# ---- 5. a damaged trace is refused, naming the file and the offset
head -c $((32 + 24 * 5 + 7)) "$trace" >"$E2E_TMP/cut.trace"
err=$("$VDSTREAM_BIN" size --trace "$E2E_TMP/cut.trace" 2>&1) && fail "a cut trace was accepted"
grep -q "cut.trace: truncated at byte offset 152" <<<"$err" || fail "unclear error for a cut trace: $err"
err=$("$VDSTREAM_BIN" size --trace "$base" 2>&1) && fail "a disk image was accepted as a trace"
grep -q "is not a vdstream I/O trace" <<<"$err" || fail "unclear error for a non-trace: $err"
log "ok: damaged traces are refused with the file and offset"
