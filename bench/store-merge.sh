#!/usr/bin/env bash
# bench/store-merge.sh — how fast a vDisk's versions are merged, beside qemu-img doing the
# same job on the same chain, one after the other on the same machine:
#   merge (the versions v1..vN into one new version over the base):
#     vdstream-merge       merge_layers(vN, Some(base), out)  (crates/qcow2/examples/merge.rs)
#     qemu-img-commit      qemu-img commit -d -b v1 vN  (in place, on a fresh copy of v1..vN
#                          made before the clock starts: v2..vN written into v1; -d: vN
#                          is not emptied afterwards, which the store would not need)
#     qemu-img-rebase      qemu-img rebase -b base.qcow2 -F qcow2 vN  (in place, on a fresh
#                          copy: what v1..vN-1 hold and vN does not is written into vN)
#   (`qemu-img convert -B base` is no peer: it copies only what vN itself holds, assuming
#   vN's backing is the new base, so over a longer chain its output is wrong.)
#   flatten (the whole chain into a new base):
#     vdstream-flatten     merge_layers(vN, None, out)
#     qemu-img-convert     qemu-img convert -O qcow2 vN out
# Each is timed until its output is durable (the command, then `sync OUT`; vdstream
# already fsyncs). MB/s = bytes of data the output holds itself (qemu-img map, depth 0)
# / seconds, so each peer is credited with what it actually wrote. The chain is
# bench/lib.sh make_store_chain (random base + N versions of PCT% random 64 KiB writes),
# read once beforehand (warm page cache). With --rounds R each job runs R times, the order
# rotating; the median is shown with per-round values and the ratio to the qemu peers.
#
# Usage: bench/store-merge.sh [--size-mib 1024] [--layers 5] [--pct 10] [--rounds 3]
#                             [--quick] [--out FILE]
#   --quick   --size-mib 128 --rounds 1 (to check the script)
# Environment: MERGE_BIN (default target/release/examples/merge; build it with
# `cargo build --release -p vdstream-qcow2 --example merge`).

set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"
MERGE_BIN=${MERGE_BIN:-$ROOT/target/release/examples/merge}

mib=1024 layers=5 pct=10 rounds=3 out=''
args_given="$*"
while (($#)); do
    case $1 in
    --size-mib) mib=$2; shift ;;
    --layers) layers=$2; shift ;;
    --pct) pct=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --quick) mib=128 rounds=1 ;;
    --out) out=$2; shift ;;
    -h | --help) bench_help ;;
    *) bench_bad_arg "$1" ;;
    esac
    shift
done
for v in mib layers pct rounds; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || { echo "--${v} must be a positive integer" >&2; exit 2; }
done
((layers >= 2)) || { echo "--layers must be at least 2 (qemu-img commit needs v1 and a layer above)" >&2; exit 2; }
need_cmds qemu-img qemu-io
[[ -x $MERGE_BIN ]] || { echo "store-merge.sh: $MERGE_BIN not built (cargo build --release -p vdstream-qcow2 --example merge)" >&2; exit 2; }

work=$(mktemp -d "${TMPDIR:-/tmp}/vdstream-bench-merge.XXXXXX")
bench_cleanup_on_exit

echo "building the chain: ${mib} MiB base + $layers versions of ${pct}% 64 KiB writes" >&2
make_store_chain "$work" "$mib" "$layers" "$pct"
top=v$layers.qcow2
cat "$work"/*.qcow2 >/dev/null
cd "$work"

# own_data IMAGE — bytes of data IMAGE holds itself.
own_data() {
    qemu-img map --output=json "$1" | "$PY" -c 'import json,sys; print(sum(e["length"] for e in json.load(sys.stdin) if e["depth"] == 0 and e["data"]))'
}

# timed NAME ROUND — run job NAME once; appends "NAME ROUND seconds bytes" to results.
timed() {
    local name=$1 r=$2 t0 t1 result
    rm -rf out.qcow2 commit
    if [[ $name == qemu-img-commit || $name == qemu-img-rebase ]]; then
        mkdir commit
        cp v*.qcow2 commit/
        ln -s ../base.qcow2 commit/base.qcow2
        cat commit/v*.qcow2 >/dev/null
        sync
    fi
    t0=$(date +%s.%N)
    case $name in
    vdstream-merge) "$MERGE_BIN" "$top" base.qcow2 out.qcow2 >/dev/null ;;
    qemu-img-rebase) qemu-img rebase -q -b base.qcow2 -F qcow2 "commit/$top" && sync "commit/$top" ;;
    qemu-img-commit) qemu-img commit -q -d -b v1.qcow2 "commit/$top" && sync commit/v1.qcow2 ;;
    vdstream-flatten) "$MERGE_BIN" "$top" - out.qcow2 >/dev/null ;;
    qemu-img-convert) qemu-img convert -O qcow2 "$top" out.qcow2 && sync out.qcow2 ;;
    esac
    t1=$(date +%s.%N)
    if [[ $name == qemu-img-commit || $name == qemu-img-rebase ]]; then
        result=commit/v1.qcow2
        [[ $name == qemu-img-rebase ]] && result=commit/$top
        qemu-img compare -q "$top" "$result" || { echo "$name: result differs from the chain" >&2; exit 1; }
    else
        result=out.qcow2
        qemu-img compare -q "$top" out.qcow2 || { echo "$name: output differs from the chain" >&2; exit 1; }
    fi
    echo "$name $r $("$PY" -c "print(f'{$t1 - $t0:.3f}')") $(own_data "$result")" >>results
    echo "round $((r + 1))/$rounds: $name $(tail -n1 results | cut -d' ' -f3)s" >&2
}

jobs=(vdstream-merge qemu-img-commit qemu-img-rebase vdstream-flatten qemu-img-convert)
n=${#jobs[@]}
: >results
for ((r = 0; r < rounds; r++)); do
    for ((k = 0; k < n; k++)); do
        timed "${jobs[(k + r) % n]}" "$r"
        sleep 1
    done
done

table=$("$PY" - results "$rounds" <<'PYEOF'
import statistics, sys
rows = [l.split() for l in open(sys.argv[1])]
res = {}
for name, r, secs, data in rows:
    res.setdefault(name, []).append((float(secs), int(data)))
med = {}
for name, runs in res.items():
    mbs = [d / s / 1e6 for s, d in runs]
    med[name] = (statistics.median(s for s, _ in runs), statistics.median(mbs), runs[0][1], mbs)
def line(name, refs):
    s, mbs, data, all_mbs = med[name]
    ratios = " / ".join(f"{mbs / med[r][1]:.2f}" for r in refs if r in med) or "—"
    print(f"| {name} | {data / 1e6:.0f} | {s:.2f} | {mbs:.0f} | {ratios} | {[round(x) for x in all_mbs]} |")
print("| job | data written (MB) | seconds (median) | MB/s (median) | vs qemu | MB/s per round |")
print("| --- | ---: | ---: | ---: | ---: | --- |")
line("vdstream-merge", ["qemu-img-commit", "qemu-img-rebase"])
line("qemu-img-commit", [])
line("qemu-img-rebase", [])
line("vdstream-flatten", ["qemu-img-convert"])
line("qemu-img-convert", [])
print()
print("vs qemu: MB/s ratio of vdstream-merge to qemu-img-commit / qemu-img-rebase; of vdstream-flatten to qemu-img-convert.")
PYEOF
)

header="### Merging versions

\`bench/store-merge.sh ${args_given}\` — $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, $(qemu-img --version | head -n1);
chain: ${mib} MiB random base (qcow2) + $layers qcow2 versions of ${pct}% random 64 KiB writes each;
page cache warm; every job timed until its output is fsynced; median of $rounds round(s), order rotating.
"
printf '%s\n%s\n' "$header" "$table"
if [[ -n $out ]]; then
    printf '%s\n%s\n' "$header" "$table" >"$out"
    echo "wrote $out" >&2
fi
