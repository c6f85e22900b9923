#!/usr/bin/env bash
# bench/s3.sh — issue 21's figures for a store on object storage, in one run, on a real
# 3-node Garage cluster on 127.0.0.1 (replication factor 3; tests/e2e/garage-lib.sh):
#   1. read IOPS through `vdstream server`, the same vDisk from the local folder store and
#      from s3:// (copied up by `vdstream store copy`): fio's nbd engine, the VDI profile's
#      shape for reads (4 jobs × QD16, 4 KiB, 90% random; reads only, as an export of a
#      sealed version takes no writes), --runtime seconds on a freshly started server
#      (cold: the s3 server's chunk cache is empty) and again on the same server (warm).
#      Cold is one pass of as many reads as the vDisk has 4 KiB blocks; warm is --runtime
#      seconds after it. Stores alternate within each of --rounds rounds. The server's
#      shared read cache is off (--read-cache 0, the default here), so that warm reads
#      measure the page cache against the chunk cache, not the read cache for both. The
#      local store's file is in the page cache (this machine cannot drop it), so its cold
#      run is warm for the kernel.
#   2. a cold boot storm: --targets agents attach to one fresh s3 server and every guest
#      reads the whole vDisk at once (nbdcopy, as bench/server-read-fanout.sh); the
#      bytes the server fetched from Garage (its chunk counters) against the bytes the
#      vDisk's chain stores (zero chunks are not stored).
#   3. what a new version uploads: a version with --changed MiB written in 64 KiB writes,
#      then one written in scattered 4 KiB writes (each dirties a 64 KiB qcow2 cluster),
#      each promoted and copied up; the bytes the copy sent against the bytes written.
# Prints a Markdown report (and writes it to --out FILE).
#
# Usage: bench/s3.sh [--size 512M] [--runtime 15] [--rounds 3] [--targets 16]
#                    [--changed 16] [--read-cache 0] [--out FILE]
# Needs: garage (GARAGE_BIN, else scripts/test's build, else PATH), fio, nbdcopy, qemu-io.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"

size=512M runtime=15 rounds=3 targets=16 changed=16 read_cache=0 out='' args_given="$*"
while (($#)); do
    case $1 in
    --size) size=$2; shift ;;
    --runtime) runtime=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --targets) targets=$2; shift ;;
    --changed) changed=$2; shift ;;
    --read-cache) read_cache=$2; shift ;;
    --out) out=$2; shift ;;
    -h | --help) bench_help ;;
    *) bench_bad_arg "$1" ;;
    esac
    shift
done
need_rounds_runtime
need_vdstream
need_cmds fio nbdcopy qemu-io
((targets >= 1 && targets <= 32)) || { echo "--targets must be 1..32" >&2; exit 2; }
[[ $changed =~ ^[1-9][0-9]*$ ]] || { echo "--changed must be whole MiB" >&2; exit 2; }
size_bytes=$(numfmt --from=iec "${size^^}")
GARAGE_BIN=${GARAGE_BIN:-$HOME/.cache/vdstream/garage-2.5.0/bin/garage}
[[ -x $GARAGE_BIN ]] || GARAGE_BIN=$(command -v garage || true)
[[ -x $GARAGE_BIN ]] || { echo "s3.sh: garage not found: run scripts/test once (it builds it) or set GARAGE_BIN" >&2; exit 2; }

work=$(mktemp -d "${TMPDIR:-/tmp}/vdstream-s3.XXXXXX")
# tests/e2e/garage-lib.sh's helpers, outside the e2e harness.
E2E_TMP=$work
E2E_PIDS=()
log() { echo "$*" >&2; }
fail() { echo "s3.sh: $*" >&2; exit 1; }
# shellcheck source=../tests/e2e/garage-lib.sh
source "$ROOT/tests/e2e/garage-lib.sh"
server_pid=''
extra_pids=()
_s3_cleanup() {
    local rc=$? p
    for p in "${extra_pids[@]}" "$server_pid" "${E2E_PIDS[@]}"; do stop_pid "$p" 50; done
    rm -rf "$work"
    exit "$rc"
}
trap _s3_cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
export VDSTREAM_STORE=$work/store VDSTREAM_CACHE_DIR=$work/agent-cache
S3=s3://vdstream-test/bench

garage_start 2>/dev/null
echo "making the vDisk: $size of random data, copied up to $S3" >&2
head -c "$size_bytes" /dev/urandom >"$work/golden.img"
"$VDSTREAM_BIN" vdisk import golden "$work/golden.img" >/dev/null
rm -f "$work/golden.img"
"$VDSTREAM_BIN" store copy --from "$VDSTREAM_STORE" --to "$S3" --json >"$work/copy0.json"

# serve STORE SOCK [ARGS] — start `vdstream server` and wait for its socket to answer.
serve() {
    local store=$1 sock=$2; shift 2
    rm -f "$sock"
    "$VDSTREAM_BIN" server --store "$store" --socket "$sock" "$@" >"$work/server.log" 2>&1 </dev/null &
    server_pid=$!
    for _ in $(seq 600); do
        kill -0 "$server_pid" 2>/dev/null || { cat "$work/server.log" >&2; fail "the server on $store exited"; }
        [[ -S $sock ]] && timeout 5 nbdinfo --list "nbd+unix:///?socket=$sock" >/dev/null 2>&1 && return 0
        sleep 0.1
    done
    fail "the server on $store did not list its exports in 60 s"
}

# read_iops URI OUT cold|warm — the VDI profile's shape, reads only; writes fio's JSON to
# OUT. Cold: one pass, as many 4 KiB reads in all as the vDisk has blocks (the first
# reads of a fresh server); warm: --runtime seconds.
read_iops() {
    local how=(--runtime="$runtime" --time_based)
    [[ $3 == cold ]] && how=(--number_ios=$((size_bytes / 4096 / 4)))
    fio --name=vdi-read --ioengine=nbd --uri="$1" --rw=randread --percentage_random=90 --bs=4k \
        --iodepth=16 --numjobs=4 --group_reporting --size="$size_bytes" "${how[@]}" \
        --output-format=json --output="$2" >/dev/null
}

for ((r = 0; r < rounds; r++)); do
    if ((r % 2 == 0)); then order=(local s3); else order=(s3 local); fi
    for s in "${order[@]}"; do
        echo "round $((r + 1))/$rounds: $s, cold then warm" >&2
        if [[ $s == local ]]; then
            serve "$VDSTREAM_STORE" "$work/srv.sock" --read-cache "$read_cache"
        else
            rm -rf "$work/objcache"
            serve "$S3" "$work/srv.sock" --read-cache "$read_cache" --object-cache "$work/objcache" --object-cache-ram 1G --object-cache-disk 0
        fi
        read_iops "nbd+unix:///vdisk/golden?socket=$work/srv.sock" "$work/$s.$r.cold.json" cold
        read_iops "nbd+unix:///vdisk/golden?socket=$work/srv.sock" "$work/$s.$r.warm.json" warm
        stop_pid "$server_pid"; server_pid=
    done
done

echo "cold boot storm: $targets targets read the whole vDisk through one fresh s3 server" >&2
rm -rf "$work/objcache"
serve "$S3" "$work/srv.sock" --read-cache "$read_cache" --object-cache "$work/objcache" --object-cache-ram 1G --object-cache-disk 0
for ((i = 0; i < targets; i++)); do
    VDSTREAM_RUN_DIR=$work/run "$VDSTREAM_BIN" target attach "t$i" --server "nbd+unix:///vdisk/golden?socket=$work/srv.sock" \
        --cache ram-overflow --ram 64M >"$work/t$i.log" 2>&1 </dev/null &
    extra_pids+=($!)
done
for ((i = 0; i < targets; i++)); do wait_nbd_ready "${extra_pids[i]}" "$work/run/t$i.sock" "$work/t$i.log" "agent t$i" 60 || exit 1; done
t0=$(date +%s.%N)
readers=()
for ((i = 0; i < targets; i++)); do
    timeout 600 nbdcopy --no-extents -C 1 "nbd+unix:///?socket=$work/run/t$i.sock" null: &
    readers+=($!)
done
for p in "${readers[@]}"; do wait "$p" || fail "a reader failed in the boot storm"; done
t1=$(date +%s.%N)
echo "$t0 $t1" >"$work/storm.time"
sleep 2.5   # the chunk counters are written with each metadata refresh (2 s)
cp "$work/objcache/vdstream-test/bench/object-stats.json" "$work/storm.stats.json"
for p in "${extra_pids[@]}"; do stop_pid "$p" 100; done
extra_pids=()
stop_pid "$server_pid"; server_pid=

# new_version KIND — a maintenance version with $changed MiB written (KIND 64k: aligned
# 64 KiB writes; 4k: 4 KiB writes, one per 64 KiB cluster), promoted, copied up.
new_version() {
    local kind=$1 v
    v=$("$VDSTREAM_BIN" version new golden --json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["version"]["number"])')
    "$VDSTREAM_BIN" serve-image --vdisk golden@maintenance --socket "$work/m.sock" >"$work/m.log" 2>&1 </dev/null &
    server_pid=$!
    wait_nbd_ready "$server_pid" "$work/m.sock" "$work/m.log" "maintenance server" 60 || exit 1
    "$PY" - "$size_bytes" "$changed" "$kind" <<'PYEOF' | qemu-io -f raw "nbd+unix:///?socket=$work/m.sock" >/dev/null
import random, sys
size, mib, kind = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
rng = random.Random(7 if kind == "64k" else 11)
clusters = rng.sample(range(size // 65536), mib * (16 if kind == "64k" else 256))
for c in clusters:
    if kind == "64k":
        print(f"write -P {rng.randrange(1, 256)} {c * 65536} 64k")
    else:
        print(f"write -P {rng.randrange(1, 256)} {c * 65536 + rng.randrange(16) * 4096} 4k")
PYEOF
    stop_pid "$server_pid"; server_pid=
    "$VDSTREAM_BIN" version promote golden "$v" --to production >/dev/null
    "$VDSTREAM_BIN" store copy --from "$VDSTREAM_STORE" --to "$S3" --json >"$work/copy-$kind.json"
}
echo "new versions: $changed MiB in 64 KiB writes, then in 4 KiB writes; each copied up" >&2
new_version 64k
new_version 4k

report=$("$PY" - "$work" "$rounds" "$targets" "$size_bytes" "$changed" "$runtime" "$args_given" <<'PYEOF'
import json, statistics, sys
work, rounds, targets, size, changed, runtime, args = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], sys.argv[7]
MiB = 1 << 20
def iops(f):
    j = json.load(open(f))
    return sum(job["read"]["iops"] for job in j["jobs"])
out = [f"`bench/s3.sh {args}`: a {size // MiB} MiB vDisk of random data, 3 Garage 2.5.0 nodes on 127.0.0.1 (replication factor 3), "
       f"fio nbd engine, 4 jobs × QD16, 4 KiB, 90% random reads; cold: one pass of {size // 4096:,} reads on a fresh server, warm: {runtime} s after it; "
       f"{rounds} rounds; IOPS.", "",
       "| round | local cold | s3 cold | cold s3/local | local warm | s3 warm | warm s3/local |", "|---:|---:|---:|---:|---:|---:|---:|"]
cold, warm = [], []
for r in range(rounds):
    lc, sc = iops(f"{work}/local.{r}.cold.json"), iops(f"{work}/s3.{r}.cold.json")
    lw, sw = iops(f"{work}/local.{r}.warm.json"), iops(f"{work}/s3.{r}.warm.json")
    cold.append(sc / lc); warm.append(sw / lw)
    out.append(f"| {r + 1} | {lc:,.0f} | {sc:,.0f} | {sc / lc:.2f}× | {lw:,.0f} | {sw:,.0f} | {sw / lw:.2f}× |")
out.append(f"| median | | | **{statistics.median(cold):.2f}×** | | | **{statistics.median(warm):.2f}×** |")
st = json.load(open(f"{work}/storm.stats.json"))["chunks"]
copy0 = json.load(open(f"{work}/copy0.json"))
stored = copy0["bytes_moved"]
t0, t1 = map(float, open(f"{work}/storm.time").read().split())
out += ["", f"Cold boot storm: {targets} targets (agents, `ram-overflow`) each read the whole vDisk at once through one fresh s3 server "
        f"({t1 - t0:.1f} s): guests read {targets * size / MiB:,.0f} MiB.", "",
        "| GETs | bytes fetched | the chain stores | fetched / stored | GETs per MiB stored | reads that waited on another's GET | RAM hits | read-ahead GETs | checksum failures |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        f"| {st['gets']:,} | {st['get_bytes'] / MiB:,.1f} MiB | {stored / MiB:,.1f} MiB | **{st['get_bytes'] / stored:.3f}×** | {st['gets'] / (stored / MiB):.3f} | {st['shared_waits']:,} | {st['ram_hits']:,} | {st['readahead']:,} | {st['corrupt']} |"]
out += ["", "New versions copied up (each: promote, then `vdstream store copy`):", "",
        "| writes | bytes written | layers sent | bytes sent | sent / written |", "|---|---:|---:|---:|---:|"]
for kind, label in (("64k", "64 KiB, aligned"), ("4k", "4 KiB, one per 64 KiB cluster")):
    c = json.load(open(f"{work}/copy-{kind}.json"))
    written = changed * MiB if kind == "64k" else changed * 256 * 4096
    sent_layers = c["layers"] - c["layers_skipped"]
    out.append(f"| {label} | {written / MiB:,.1f} MiB | {sent_layers} | {c['bytes_moved'] / MiB:,.2f} MiB | **{c['bytes_moved'] / written:.2f}×** |")
print("\n".join(out))
PYEOF
)
echo "$report"
[[ -z $out ]] || echo "$report" >"$out"
