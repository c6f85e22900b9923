#!/usr/bin/env bash
# bench/agent-hop.sh — the cost of the agent hop under the VDI profile (shared/bench/vdi.fio:
# 4 jobs x QD16, 4 KiB, 80% writes, 90% random), fio's nbd engine over unix sockets, on a
# base image of --size random data:
#   direct   vdstream serve-image BASE --cache ram-overflow --ram 2G           (the cache in the server)
#   agent    vdstream serve-image BASE --read-only  +
#            vdstream target attach hop --server nbd+unix:///?socket=S --cache ram-overflow --ram 2G
#            (fio talks to the agent; the agent reads the base from the server over NBD)
# Each round runs both, alternating which goes first; caches start empty. Prints total IOPS
# per round, the medians and agent/direct.
#
# Usage: bench/agent-hop.sh [--size 1g] [--runtime 15] [--rounds 3]
# Environment: SHARED (default: the `shared` folder beside the repo), VDSTREAM_BIN, TMPDIR.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"

size=1g runtime=15 rounds=3
args_given="$*"
while (($#)); do
    case $1 in
    --size) size=$2; shift ;;
    --runtime) runtime=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    -h | --help) bench_help ;;
    *) bench_bad_arg "$1" ;;
    esac
    shift
done
need_jobfile
need_vdstream
size_bytes=$(numfmt --from=iec "${size^^}")

work=$(mktemp -d "${TMPDIR:-/tmp}/vdstream-agent-hop.XXXXXX")
server_pid='' agent_pid=''
BENCH_PID_VARS="agent_pid server_pid"
bench_cleanup_on_exit
export VDSTREAM_RUN_DIR=$work/run VDSTREAM_CACHE_DIR=$work/cache

base=$work/base.img
echo "making the base image: $size of random data in $work" >&2
head -c "$size_bytes" /dev/urandom >"$base"

# run_peer NAME ROUND — start the peer, run fio against it, stop it.
run_peer() {
    local name=$1 r=$2 ssock=$work/server.sock uri
    case $name in
    direct)
        "$VDSTREAM_BIN" serve-image "$base" --socket "$ssock" --cache ram-overflow --ram 2G \
            --overflow-dir "$work" >"$work/$name.$r.server.log" 2>&1 </dev/null &
        server_pid=$!
        wait_nbd_ready "$server_pid" "$ssock" "$work/$name.$r.server.log" server 30
        uri="nbd+unix:///?socket=$ssock" ;;
    agent)
        "$VDSTREAM_BIN" serve-image "$base" --socket "$ssock" --read-only \
            >"$work/$name.$r.server.log" 2>&1 </dev/null &
        server_pid=$!
        wait_nbd_ready "$server_pid" "$ssock" "$work/$name.$r.server.log" server 30
        "$VDSTREAM_BIN" target attach hop --server "nbd+unix:///?socket=$ssock" --cache ram-overflow \
            --ram 2G >"$work/$name.$r.agent.log" 2>&1 </dev/null &
        agent_pid=$!
        wait_nbd_ready "$agent_pid" "$work/run/hop.sock" "$work/$name.$r.agent.log" agent 30
        uri="nbd+unix:///?socket=$work/run/hop.sock" ;;
    esac
    fio "$JOBFILE" --ioengine=nbd --uri="$uri" --size="$size" --runtime="$runtime" \
        --output-format=json --output="$work/$name.$r.json" >"$work/$name.$r.fio.log" 2>&1 ||
        { cat "$work/$name.$r.fio.log" >&2; echo "fio failed against $name" >&2; exit 1; }
    stop_pid "$agent_pid"; agent_pid=
    stop_pid "$server_pid"; server_pid=
    sleep 1
}

for ((r = 0; r < rounds; r++)); do
    if ((r % 2 == 0)); then order=(direct agent); else order=(agent direct); fi
    for p in "${order[@]}"; do
        echo "round $((r + 1))/$rounds: $p" >&2
        run_peer "$p" "$r"
    done
done

table=$("$PY" - "$work" "$rounds" <<'PYEOF'
import json, statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
def load(p, i):
    text = open(f"{work}/{p}.{i}.json").read()
    job = json.loads(text[text.index("{"):])["jobs"][0]
    assert job["error"] == 0, f"fio error against {p}"
    r, w = job["read"], job["write"]
    rio, wio = r["total_ios"], w["total_ios"]
    lat = (r["lat_ns"]["mean"] * rio + w["lat_ns"]["mean"] * wio) / max(1, rio + wio) / 1000
    return r["iops"] + w["iops"], r["iops"], w["iops"], lat
res = {p: [load(p, i) for i in range(rounds)] for p in ("direct", "agent")}
med = {p: [statistics.median(x[k] for x in runs) for k in range(4)] for p, runs in res.items()}
print("| path | total IOPS | read IOPS | write IOPS | mean latency (µs) | vs direct | total IOPS per round |")
print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
label = {"direct": "fio → `serve-image --cache ram-overflow`", "agent": "fio → agent `--cache ram-overflow` → `serve-image --read-only`"}
for p in ("direct", "agent"):
    t, rd, wr, lat = med[p]
    print(f"| {label[p]} | {t:.0f} | {rd:.0f} | {wr:.0f} | {lat:.0f} | {t / med['direct'][0]:.2f} | {', '.join(str(round(x[0])) for x in res[p])} |")
ratios = [a[0] / d[0] for a, d in zip(res["agent"], res["direct"])]
print()
print(f"(median of {rounds} rounds; agent/direct per round: {', '.join(f'{x:.2f}' for x in ratios)})")
PYEOF
)
echo
echo "\`bench/agent-hop.sh ${args_given}\` — $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, $(fio --version), size=$size runtime=${runtime}s"
echo
echo "$table"
