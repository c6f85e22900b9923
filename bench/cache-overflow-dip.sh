#!/usr/bin/env bash
# bench/cache-overflow-dip.sh — what ram-overflow costs when the working set outgrows RAM.
# Pairs of runs of the VDI profile (shared/bench/vdi.fio: 4 jobs x QD16, 4 KiB, 80% writes, 90%
# random) with fio's nbd engine over a unix socket, on a 96 MiB working set over a base of
# random data, each with an empty cache:
#   overflow   vdstream serve-image BASE --cache ram-overflow --ram 64M   (working set 1.5x RAM)
#   fits       vdstream serve-image BASE --cache ram-overflow --ram 256M  (never overflows)
# fio logs IOPS every 250 ms (--write_iops_log, --log_avg_msec=250, summed over jobs and
# directions); a poller reads the allocated size of the server's overflow file (unlinked,
# found through /proc/PID/fd) every 100 ms, which dates the moment overflow starts. Printed:
#   - sustained IOPS of each run (mean over the second half of the run) and their ratio
#     overflow/fits (goal >= 0.9), per round and the median over rounds (with --rounds N the
#     pair runs N times, which run goes first alternating by round);
#   - the dip: the lowest 250 ms window after overflow starts vs the overflow run's
#     sustained IOPS, and how long it lasts (from overflow start until four windows in a
#     row, 1 s, are back at >= 90% of sustained).
#
# Usage: bench/cache-overflow-dip.sh [--runtime 20] [--ws 96m] [--rounds 5] [--quick] [--out FILE] [--keep DIR]
#   --quick   --runtime 6 --rounds 1 (to check the script, not for figures)
# Environment: SHARED (default: the `shared` folder beside the repo), VDSTREAM_BIN, TMPDIR.

set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"

runtime=20 ws=96m rounds=5 out='' keep=''
args_given="$*"
while (($#)); do
    case $1 in
    --runtime) runtime=$2; shift ;;
    --ws) ws=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --quick) runtime=6 rounds=1 ;;
    --out) out=$2; shift ;;
    --keep) keep=$2; shift ;;
    -h | --help) bench_help ;;
    *) bench_bad_arg "$1" ;;
    esac
    shift
done
need_rounds_runtime
need_jobfile
need_vdstream
need_cmds fio nbdinfo numfmt
ws_bytes=$(numfmt --from=iec "${ws^^}")

work=$(mktemp -d "${TMPDIR:-/tmp}/vdstream-dip-bench.XXXXXX")
server_pid='' poller_pid=''
BENCH_PID_VARS="poller_pid server_pid"
bench_cleanup_on_exit

base=$work/base.img
# The base is twice the working set, random data throughout.
head -c $((2 * ws_bytes)) /dev/urandom >"$base"

# poll_overflow PID DIR OUT — every 100 ms, "epoch_seconds allocated_bytes" of PID's files under DIR.
poll_overflow() {
    local pid=$1 dir=$2 outf=$3 fd target total
    while kill -0 "$pid" 2>/dev/null; do
        total=0
        for fd in /proc/"$pid"/fd/*; do
            target=$(readlink "$fd" 2>/dev/null) || continue
            [[ $target == "$dir"/* ]] || continue
            total=$((total + $(stat -L -c %b "$fd" 2>/dev/null || echo 0) * 512))
        done
        echo "$EPOCHREALTIME $total" >>"$outf"
        sleep 0.1
    done
}

run_one() { # run_one NAME RAM
    local name=$1 ram=$2 sock=$work/$1.sock cdir=$work/cache.$1
    mkdir -p "$cdir"
    echo "run $name: ram-overflow --ram $ram, working set $ws, ${runtime}s" >&2
    "$VDSTREAM_BIN" serve-image "$base" --cache ram-overflow --ram "$ram" --overflow-dir "$cdir" \
        --socket "$sock" >"$work/$name.server.log" 2>&1 </dev/null &
    server_pid=$!
    wait_nbd_ready "$server_pid" "$sock" "$work/$name.server.log" "server" 20 || exit 1
    poll_overflow "$server_pid" "$cdir" "$work/$name.overflow" &
    poller_pid=$!
    echo "$EPOCHREALTIME" >"$work/$name.start"
    (cd "$work" && fio "$JOBFILE" --ioengine=nbd --uri="nbd+unix:///?socket=$sock" \
        --size="$ws" --runtime="$runtime" --write_iops_log="$name" --log_avg_msec=250 \
        --output-format=json --output="$work/$name.json") >"$work/$name.fio.log" 2>&1 ||
        { cat "$work/$name.fio.log" >&2; echo "fio failed against $name" >&2; exit 1; }
    stop_pid "$server_pid"
    wait "$poller_pid" 2>/dev/null || true
    server_pid='' poller_pid=''
    rm -rf "$cdir"
}

for ((r = 1; r <= rounds; r++)); do
    if ((r % 2)); then order="overflow fits"; else order="fits overflow"; fi
    for kind in $order; do
        if [[ $kind == overflow ]]; then run_one "overflow.r$r" 64M; else run_one "fits.r$r" 256M; fi
        sleep 1
    done
done
if [[ -n $keep ]]; then
    mkdir -p "$keep"
    cp "$work"/*.log "$work"/*.json "$work"/*.overflow "$keep"/ 2>/dev/null || true
fi

report=$("$PY" - "$work" "$runtime" "$rounds" <<'PYEOF'
import glob, json, statistics, sys
work, runtime = sys.argv[1], int(sys.argv[2])
W = 250  # ms per window

def windows(name):
    # fio writes NAME_iops.N.log per job: "msec, iops, dir, bs, offset"; sum jobs and directions.
    acc = {}
    for path in glob.glob(f"{work}/{name}_iops.*.log"):
        for line in open(path):
            f = [x.strip() for x in line.split(",")]
            if len(f) < 3:
                continue
            k = round(int(f[0]) / W)
            acc[k] = acc.get(k, 0) + int(f[1])
    ks = sorted(acc)
    return [(k * W / 1000, acc[k]) for k in ks if k >= 1]

def overflow_start(name):
    t0 = float(open(f"{work}/{name}.start").read())
    try:
        for line in open(f"{work}/{name}.overflow"):
            t, b = line.split()
            if int(b) > 0:
                return float(t.replace(",", ".")) - t0, None
    except FileNotFoundError:
        pass
    return None, None

def total_iops(name):
    text = open(f"{work}/{name}.json").read()
    j = json.loads(text[text.index("{"):])["jobs"][0]
    return j["read"]["iops"] + j["write"]["iops"]

def run_stats(name):
    w = windows(name)
    half = [v for t, v in w if t > runtime / 2]
    return {"w": w, "sustained": statistics.mean(half) if half else float("nan"),
            "start": overflow_start(name)[0], "total": total_iops(name)}

def dip(o):
    """(lowest window after overflow starts / sustained, seconds until 4 windows >= 90%)."""
    if o["start"] is None:
        return None, None
    s = o["sustained"]
    after = [v for t, v in o["w"] if t >= o["start"]]
    if not after:
        return None, None
    end = None
    for i in range(len(after)):
        if len(after[i:i + 4]) == 4 and all(v >= 0.9 * s for v in after[i:i + 4]):
            end = i
            break
    return min(after) / s, (None if end is None else end * W / 1000)

rounds = int(sys.argv[3])
rows = []
for r in range(1, rounds + 1):
    o, f = run_stats(f"overflow.r{r}"), run_stats(f"fits.r{r}")
    low, lasts = dip(o)
    rows.append((r, o, f, o["sustained"] / f["sustained"], o["total"] / f["total"], low, lasts))

print("| round | overflow sustained | fits sustained | **ratio** | overflow whole-run | fits whole-run | whole-run ratio | overflow starts | lowest window after it / sustained | dip lasts |")
print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for r, o, f, ratio, whole, low, lasts in rows:
    st = "never" if o["start"] is None else f"{o['start']:.2f} s"
    lo = "n/a" if low is None else f"{low:.2f}"
    la = "n/a" if low is None else ("to the end" if lasts is None else f"{lasts:.2f} s")
    print(f"| {r} | {o['sustained']:.0f} | {f['sustained']:.0f} | {ratio:.2f} | {o['total']:.0f} | {f['total']:.0f} | {whole:.2f} | {st} | {lo} | {la} |")
print()
med = statistics.median(x[3] for x in rows)
medw = statistics.median(x[4] for x in rows)
print(f"- median sustained overflow/fits over {rounds} round(s) = **{med:.2f}** (goal >= 0.9: {'met' if med >= 0.9 else 'NOT met'}); whole-run median {medw:.2f}")
print("- the dip: the lowest 250 ms window once the overflow file starts growing, against the run's sustained rate; "
      "it lasts until four windows in a row (1 s) are back at >= 90% of sustained")
print()
for r, o, f, *_ in rows:
    print(f"round {r}, IOPS per 250 ms window in thousands — overflow: " + " ".join(f"{v / 1000:.0f}" for t, v in o["w"]))
    print(f"round {r}, fits: " + " ".join(f"{v / 1000:.0f}" for t, v in f["w"]))
PYEOF
)
header="### ram-overflow: overflow dip and sustained IOPS

\`bench/cache-overflow-dip.sh ${args_given}\` — $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, $(fio --version),
VDI profile (\`shared/bench/vdi.fio\`) --size=$ws --runtime=$runtime, $rounds round(s), over nbd+unix, base of random data,
overflow dir on $(stat -f -c %T "$work"); \`--cache ram-overflow --ram 64M\` (overflow) vs \`--ram 256M\` (fits).
"
printf '%s\n%s\n' "$header" "$report"
if [[ -n $out ]]; then printf '%s\n%s\n' "$header" "$report" >"$out"; echo "wrote $out" >&2; fi
