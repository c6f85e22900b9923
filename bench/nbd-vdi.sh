#!/usr/bin/env bash
# bench/nbd-vdi.sh — the VDI profile (shared/bench/vdi.fio: 4 jobs x QD16, 4 KiB, 80% writes,
# 90% random) run with fio's nbd engine over unix sockets against three peers, one after
# the other on the same machine:
#   vdstream        vdstream serve-image --memory 1G
#   nbdkit-memory   nbdkit memory 1G        (default thread model: parallel)
#   nbdkit-null     nbdkit null 1G          (no storage at all: the protocol's ceiling)
#   vdstream-old    like vdstream, with the binary $VDSTREAM_OLD_BIN (only when asked for
#                   in --peers: an older build to compare against)
# and prints a Markdown table: total/read/write IOPS, mean completion latency, and the
# ratio of total IOPS to nbdkit-memory and nbdkit-null. With --rounds N each peer runs N
# times, the order rotating every round (the machine is noisy), and the median is shown.
#
# Usage: bench/nbd-vdi.sh [--size 1g] [--runtime 20] [--rounds 1] [--quick] [--out FILE]
#                         [--peers vdstream,nbdkit-memory,nbdkit-null] [--keep DIR]
#   --quick       --size 256m --runtime 3 (to check the script, not for figures)
#   --out FILE    also write the table (with the command line and environment) to FILE
#   --keep DIR    keep fio's JSON output of every run in DIR
# Environment: SHARED (default: the `shared` folder beside the repo), VDSTREAM_BIN,
# VDSTREAM_OLD_BIN (for the vdstream-old peer).

set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"

size=1g runtime=20 rounds=1 out='' keep='' peers=vdstream,nbdkit-memory,nbdkit-null
args_given="$*"
while (($#)); do
    case $1 in
    --size) size=$2; shift ;;
    --runtime) runtime=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --quick) size=256m runtime=3 ;;
    --out) out=$2; shift ;;
    --keep) keep=$2; shift ;;
    --peers) peers=$2; shift ;;
    -h | --help) bench_help ;;
    *) bench_bad_arg "$1" ;;
    esac
    shift
done
need_rounds_runtime
need_jobfile
need_cmds fio nbdkit nbdinfo
IFS=, read -r -a peer_list <<<"$peers"

work=$(mktemp -d "${TMPDIR:-/tmp}/vdstream-bench.XXXXXX")
server_pid=
bench_cleanup_on_exit

# start_peer NAME SOCK — start the peer's server on SOCK; sets server_pid.
start_peer() {
    local name=$1 sock=$2
    case $name in
    vdstream) cmd=("$VDSTREAM_BIN" serve-image --memory 1G --socket "$sock") ;;
    vdstream-old) cmd=("${VDSTREAM_OLD_BIN:?set VDSTREAM_OLD_BIN for the vdstream-old peer}" serve-image --memory 1G --socket "$sock") ;;
    nbdkit-memory) cmd=(nbdkit -f -U "$sock" memory 1G) ;;
    nbdkit-null) cmd=(nbdkit -f -U "$sock" null 1G) ;;
    *) echo "unknown peer $name" >&2; return 1 ;;
    esac
    "${cmd[@]}" >"$work/$name.server.log" 2>&1 </dev/null &
    server_pid=$!
    wait_nbd_ready "$server_pid" "$sock" "$work/$name.server.log" "$name" 20
}

stop_peer() {
    stop_pid "$server_pid"
    server_pid=
}

available=()
for p in "${peer_list[@]}"; do
    if [[ $p == vdstream && ! -x $VDSTREAM_BIN ]]; then
        echo "note: $VDSTREAM_BIN not built (cargo build --release): skipping vdstream" >&2
        continue
    fi
    available+=("$p")
done
((${#available[@]})) || { echo "no peer to run" >&2; exit 1; }

n=${#available[@]}
for ((r = 0; r < rounds; r++)); do
    for ((k = 0; k < n; k++)); do
        p=${available[(k + r) % n]}
        sock=$work/$p.$r.sock
        echo "round $((r + 1))/$rounds: $p (size=$size runtime=${runtime}s)" >&2
        start_peer "$p" "$sock" || { echo "failed to start $p" >&2; exit 1; }
        fio "$JOBFILE" --ioengine=nbd --uri="nbd+unix:///?socket=$sock" \
            --size="$size" --runtime="$runtime" \
            --output-format=json --output="$work/$p.$r.json" >"$work/$p.$r.fio.log" 2>&1 ||
            { cat "$work/$p.$r.fio.log" "$work/$p.$r.json" >&2 || true; echo "fio failed against $p" >&2; exit 1; }
        stop_peer
        sleep 1
    done
done
if [[ -n $keep ]]; then mkdir -p "$keep" && cp "$work"/*.json "$keep"/; fi

table=$("$PY" - "$work" "$rounds" "${available[@]}" <<'PYEOF'
import json, statistics, sys
work, rounds, peers = sys.argv[1], int(sys.argv[2]), sys.argv[3:]

def load(path):
    text = open(path).read()
    j = json.loads(text[text.index("{"):])   # fio may print notes before the JSON
    job = j["jobs"][0]                          # group_reporting=1: one aggregate
    r, w = job["read"], job["write"]
    rio, wio = r["total_ios"], w["total_ios"]
    lat = (r["lat_ns"]["mean"] * rio + w["lat_ns"]["mean"] * wio) / max(1, rio + wio) / 1000
    return {"total": r["iops"] + w["iops"], "read": r["iops"], "write": w["iops"], "lat": lat,
            "err": job["error"]}

res = {}
for p in peers:
    runs = [load(f"{work}/{p}.{i}.json") for i in range(rounds)]
    if any(x["err"] for x in runs):
        sys.exit(f"fio reported an error against {p}")
    res[p] = {k: statistics.median(x[k] for x in runs) for k in ("total", "read", "write", "lat")}
    res[p]["runs"] = [round(x["total"]) for x in runs]

def ratio(p, ref):
    return f"{res[p]['total'] / res[ref]['total']:.2f}" if ref in res else "n/a"

label = "median of %d rounds" % rounds if rounds > 1 else "1 round"
print(f"| peer | total IOPS | read IOPS | write IOPS | mean latency (µs) | vs nbdkit-memory | vs nbdkit-null |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
for p in peers:
    x = res[p]
    print(f"| {p} | {x['total']:.0f} | {x['read']:.0f} | {x['write']:.0f} | {x['lat']:.0f} "
          f"| {ratio(p, 'nbdkit-memory')} | {ratio(p, 'nbdkit-null')} |")
print()
print(f"({label}; total IOPS per round: " +
      "; ".join(f"{p} {x['runs']}" for p, x in res.items()) + ")")
PYEOF
)

header="### VDI profile over NBD (unix socket)

\`bench/nbd-vdi.sh ${args_given}\` — $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, $(fio --version),
$(nbdkit --version | head -n1), job file \`shared/bench/vdi.fio\` with --size=$size --runtime=$runtime;
peers: ${available[*]} (vdstream = \`vdstream serve-image --memory 1G\`, nbdkit-memory =
\`nbdkit memory 1G\`, nbdkit-null = \`nbdkit null 1G\`, nbdkit in its default parallel thread
model), each on its own unix socket, fio and server on the same machine.
"
printf '%s\n%s\n' "$header" "$table"
if [[ -n $out ]]; then
    printf '%s\n%s\n' "$header" "$table" >"$out"
    echo "wrote $out" >&2
fi
