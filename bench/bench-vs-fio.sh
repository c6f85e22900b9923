#!/usr/bin/env bash
# bench/bench-vs-fio.sh — does `vdstream bench --profile vdi` measure what fio measures?
# On each export (vdstream = `vdstream serve-image --memory 1G`, vdstream-disk = `vdstream
# serve-image BASE --cache device-disk` over a sparse base of --size with the cache file in the
# scratch dir, written once sequentially before the rounds, nbdkit-memory = `nbdkit memory 1G`), fio runs shared/bench/vdi.fio with its nbd engine and `vdstream bench`
# runs the same profile (4 workers x QD 16, 4 KiB, 80% writes, 90% random, same size and
# runtime), alternately, on the same server process. Prints a Markdown table: each tool's
# total/read/write IOPS and mean latency, and bench's total IOPS over fio's (goal: within
# 10%, 0.90-1.10). With --rounds N both run N times per export, which one goes first
# alternating per round (the machine is noisy), and medians are shown.
#
# Usage: bench/bench-vs-fio.sh [--size 1g] [--runtime 10] [--rounds 3] [--quick] [--out FILE]
#                              [--peers vdstream,vdstream-disk,nbdkit-memory] [--pin]
#   --quick       --size 256m --runtime 3 --rounds 1 (to check the script, not for figures)
#   --pin         server on CPU 0, the load generator on CPU 1 (taskset): each side has a
#                 core of its own, so a client that costs more CPU per request does not
#                 slow the server it measures
# Environment: SHARED (default: the `shared` folder beside the repo), VDSTREAM_BIN.

set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"

size=1g runtime=10 rounds=3 out='' peers=vdstream,vdstream-disk,nbdkit-memory pin=0
args_given="$*"
while (($#)); do
    case $1 in
    --size) size=$2; shift ;;
    --runtime) runtime=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --quick) size=256m runtime=3 rounds=1 ;;
    --out) out=$2; shift ;;
    --peers) peers=$2; shift ;;
    --pin) pin=1 ;;
    -h | --help) bench_help ;;
    *) bench_bad_arg "$1" ;;
    esac
    shift
done
need_rounds_runtime
need_jobfile
need_vdstream
need_cmds fio nbdkit nbdinfo
IFS=, read -r -a peer_list <<<"$peers"
server_cpu=() client_cpu=()
if ((pin)); then
    (($(nproc) >= 2)) || { echo "--pin needs 2 CPUs" >&2; exit 2; }
    server_cpu=(taskset -c 0) client_cpu=(taskset -c 1)
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/vdstream-bench.XXXXXX")
server_pid=
bench_cleanup_on_exit

start_peer() {
    local name=$1 sock=$2
    case $name in
    vdstream) cmd=("$VDSTREAM_BIN" serve-image --memory 1G --socket "$sock") ;;
    vdstream-disk)
        mkdir -p "$work/disk-cache"
        truncate -s "$size_bytes" "$work/base.img"
        cmd=("$VDSTREAM_BIN" serve-image "$work/base.img" --cache device-disk --overflow-dir "$work/disk-cache" --socket "$sock") ;;
    nbdkit-memory) cmd=(nbdkit -f -U "$sock" memory 1G) ;;
    *) echo "unknown peer $name" >&2; return 1 ;;
    esac
    "${server_cpu[@]}" "${cmd[@]}" >"$work/$name.server.log" 2>&1 </dev/null &
    server_pid=$!
    wait_nbd_ready "$server_pid" "$sock" "$work/$name.server.log" "$name" 20
}

size_bytes=$("$PY" -c 'import sys; s=sys.argv[1].lower(); u={"k":10,"m":20,"g":30}; print(int(s[:-1]) << u[s[-1]] if s[-1] in u else int(s))' "$size")
for p in "${peer_list[@]}"; do
    sock=$work/$p.sock
    start_peer "$p" "$sock" || { echo "failed to start $p" >&2; exit 1; }
    uri="nbd+unix:///?socket=$sock"
    if [[ $p == vdstream-disk ]]; then
        # One sequential pass first, so that every round finds the cache file's chunks
        # allocated: otherwise whichever tool runs first pays for the allocation.
        echo "$p: writing the whole export once (warm-up, not measured)" >&2
        fio --name=warm-up --ioengine=nbd --uri="$uri" --rw=write --bs=1m --iodepth=4 --size="$size" \
            >"$work/$p.warm-up.log" 2>&1 || { cat "$work/$p.warm-up.log" >&2; echo "warm-up failed on $p" >&2; exit 1; }
    fi
    for ((r = 0; r < rounds; r++)); do
        order=(fio bench)
        ((r % 2)) && order=(bench fio)
        for tool in "${order[@]}"; do
            echo "$p round $((r + 1))/$rounds: $tool (size=$size runtime=${runtime}s)" >&2
            case $tool in
            fio) "${client_cpu[@]}" fio "$JOBFILE" --ioengine=nbd --uri="$uri" --size="$size" --runtime="$runtime" \
                    --output-format=json --output="$work/$p.fio.$r.json" >"$work/$p.fio.$r.log" 2>&1 ||
                    { cat "$work/$p.fio.$r.log" >&2; echo "fio failed against $p" >&2; exit 1; } ;;
            bench) "${client_cpu[@]}" "$VDSTREAM_BIN" bench "$uri" --profile vdi --working-set "$size_bytes" --duration "$runtime" \
                    --json >"$work/$p.bench.$r.json" 2>"$work/$p.bench.$r.log" ||
                    { cat "$work/$p.bench.$r.log" >&2; echo "vdstream bench failed against $p" >&2; exit 1; } ;;
            esac
            sleep 1
        done
    done
    stop_pid "$server_pid"
    server_pid=
done

table=$("$PY" - "$work" "$rounds" "${peer_list[@]}" <<'PYEOF'
import json, statistics, sys
work, rounds, peers = sys.argv[1], int(sys.argv[2]), sys.argv[3:]

def fio(path):
    text = open(path).read()
    job = json.loads(text[text.index("{"):])["jobs"][0]
    r, w = job["read"], job["write"]
    rio, wio = r["total_ios"], w["total_ios"]
    lat = (r["lat_ns"]["mean"] * rio + w["lat_ns"]["mean"] * wio) / max(1, rio + wio) / 1000
    return {"total": r["iops"] + w["iops"], "read": r["iops"], "write": w["iops"], "lat": lat}

def bench(path):
    j = json.load(open(path))
    return {"total": j["total"]["iops"], "read": j["read"]["iops"], "write": j["write"]["iops"],
            "lat": j["total"]["latency"]["mean_us"]}

print("| export | tool | total IOPS | read IOPS | write IOPS | mean latency (µs) | bench / fio |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
notes = []
for p in peers:
    res = {}
    for tool, load in (("fio", fio), ("bench", bench)):
        runs = [load(f"{work}/{p}.{tool}.{i}.json") for i in range(rounds)]
        res[tool] = {k: statistics.median(x[k] for x in runs) for k in ("total", "read", "write", "lat")}
        res[tool]["runs"] = [round(x["total"]) for x in runs]
    ratio = res["bench"]["total"] / res["fio"]["total"]
    for tool in ("fio", "bench"):
        x = res[tool]
        name = "fio (nbd engine)" if tool == "fio" else "vdstream bench"
        print(f"| {p} | {name} | {x['total']:.0f} | {x['read']:.0f} | {x['write']:.0f} | {x['lat']:.0f} | "
              + (f"{ratio:.2f}" if tool == "bench" else "") + " |")
    notes.append(f"{p}: fio {res['fio']['runs']}, bench {res['bench']['runs']}")
print()
label = f"median of {rounds} rounds" if rounds > 1 else "1 round"
print(f"({label}; total IOPS per round: " + "; ".join(notes) + ")")
PYEOF
)

pin_note=''
((pin)) && pin_note='; server pinned to CPU 0, fio and bench to CPU 1 (--pin)'
header="### vdstream bench against fio, VDI profile

\`bench/bench-vs-fio.sh ${args_given}\` — $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, $(fio --version),
$(nbdkit --version | head -n1); fio runs \`shared/bench/vdi.fio\` with --size=$size --runtime=$runtime,
\`vdstream bench --profile vdi --working-set $size --duration $runtime\` the same workload, alternately on
the same server process (vdstream = \`vdstream serve-image --memory 1G\`, vdstream-disk = \`vdstream serve-image
BASE --cache device-disk\` on a sparse $size base, O_DIRECT cache file on $(stat -f -c %T "$work"), nbdkit-memory = \`nbdkit memory 1G\`),
client and server on the same machine, over a unix socket${pin_note}.
"
printf '%s\n%s\n' "$header" "$table"
if [[ -n $out ]]; then
    printf '%s\n%s\n' "$header" "$table" >"$out"
    echo "wrote $out" >&2
fi
