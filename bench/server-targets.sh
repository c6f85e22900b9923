#!/usr/bin/env bash
# bench/server-targets.sh — the server-side cache types through an agent, under the VDI
# profile (shared/bench/vdi.fio: 4 jobs x QD16, 4 KiB, 80% writes, 90% random), fio's nbd
# engine over unix sockets. One vDisk of --size random data in a fresh store, one target
# record per cache type, `vdstream server --store STORE`, and for each peer:
#   server                  vdstream target attach T --server nbd+unix:///target/T?socket=S  (cache type server)
#   server-persistent       the same, cache type server-persistent: the agent journals the
#                           writes the server answered until a flush covers them, and the
#                           server answers writes without a sync each
#   server-persistent-sync  the same with --journal-max 0: no journal, so the server makes
#                           every write durable before answering it (write-through)
# fio talks to the agent's socket. Each round runs every peer, the order rotating between
# rounds; every cache starts empty (the store's cache folder is emptied between runs).
# Prints total IOPS per round, the medians, and each peer against server-persistent-sync.
#
# Usage: bench/server-targets.sh [--size 1g] [--runtime 15] [--rounds 3]
#                                [--peers server,server-persistent,server-persistent-sync]
# Environment: SHARED (default: the `shared` folder beside the repo), VDSTREAM_BIN, TMPDIR.

set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"

size=1g runtime=15 rounds=3 peer_arg=server,server-persistent,server-persistent-sync
args_given="$*"
while (($#)); do
    case $1 in
    --size) size=$2; shift ;;
    --runtime) runtime=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --peers) peer_arg=$2; shift ;;
    -h | --help) bench_help ;;
    *) bench_bad_arg "$1" ;;
    esac
    shift
done
need_jobfile
need_vdstream
need_rounds_runtime
size_bytes=$(numfmt --from=iec "${size^^}") || { echo "--size: cannot parse $size" >&2; exit 2; }
IFS=, read -r -a peers <<<"$peer_arg"
for p in "${peers[@]}"; do
    case $p in server | server-persistent | server-persistent-sync) ;;
    *) echo "server-targets.sh: unknown peer $p (server, server-persistent, server-persistent-sync)" >&2; exit 2 ;;
    esac
done

work=$(mktemp -d "${TMPDIR:-/tmp}/vdstream-server-targets.XXXXXX")
server_pid='' agent_pid=''
BENCH_PID_VARS="agent_pid server_pid"
bench_cleanup_on_exit
export VDSTREAM_RUN_DIR=$work/run VDSTREAM_CACHE_DIR=$work/agent-cache VDSTREAM_STORE=$work/store

echo "making the vDisk: $size of random data in $work/store" >&2
head -c "$size_bytes" /dev/urandom >"$work/golden.img"
"$VDSTREAM_BIN" vdisk import golden "$work/golden.img" >/dev/null
rm -f "$work/golden.img"
"$VDSTREAM_BIN" target add ts --vdisk golden --cache server >/dev/null
"$VDSTREAM_BIN" target add tp --vdisk golden --cache server-persistent >/dev/null

# run_peer NAME ROUND — start the server and the agent, run fio against the agent, stop both.
run_peer() {
    local name=$1 r=$2 ssock=$work/server.sock id cache extra=()
    case $name in
    server) id=ts cache=server ;;
    server-persistent) id=tp cache=server-persistent ;;
    server-persistent-sync) id=tp cache=server-persistent extra=(--journal-max 0) ;;
    esac
    "$VDSTREAM_BIN" server --socket "$ssock" >"$work/$name.$r.server.log" 2>&1 </dev/null &
    server_pid=$!
    for _ in $(seq 300); do [[ -S $ssock ]] && break; sleep 0.1; done
    "$VDSTREAM_BIN" target attach "$id" --server "nbd+unix:///target/$id?socket=$ssock" \
        --cache "$cache" "${extra[@]}" >"$work/$name.$r.agent.log" 2>&1 </dev/null &
    agent_pid=$!
    wait_nbd_ready "$agent_pid" "$work/run/$id.sock" "$work/$name.$r.agent.log" agent 60
    fio "$JOBFILE" --ioengine=nbd --uri="nbd+unix:///?socket=$work/run/$id.sock" --size="$size" \
        --runtime="$runtime" --output-format=json --output="$work/$name.$r.json" >"$work/$name.$r.fio.log" 2>&1 ||
        { cat "$work/$name.$r.fio.log" >&2; echo "fio failed against $name" >&2; exit 1; }
    stop_pid "$agent_pid"; agent_pid=
    stop_pid "$server_pid"; server_pid=
    rm -rf "$work/store/cache" "$work/run"
    sleep 1
}

loads=()
for ((r = 0; r < rounds; r++)); do
    order=("${peers[@]:r % ${#peers[@]}}" "${peers[@]:0:r % ${#peers[@]}}")
    loads+=("$(cut -d' ' -f1-3 /proc/loadavg)")
    for p in "${order[@]}"; do
        echo "round $((r + 1))/$rounds: $p" >&2
        run_peer "$p" "$r"
    done
done

table=$("$PY" - "$work" "$rounds" "${peers[@]}" <<'PYEOF'
import json, statistics, sys
work, rounds, peers = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def load(p, i):
    text = open(f"{work}/{p}.{i}.json").read()
    job = json.loads(text[text.index("{"):])["jobs"][0]
    assert job["error"] == 0, f"fio error against {p}"
    r, w = job["read"], job["write"]
    rio, wio = r["total_ios"], w["total_ios"]
    lat = (r["lat_ns"]["mean"] * rio + w["lat_ns"]["mean"] * wio) / max(1, rio + wio) / 1000
    return r["iops"] + w["iops"], r["iops"], w["iops"], lat
res = {p: [load(p, i) for i in range(rounds)] for p in peers}
med = {p: [statistics.median(x[k] for x in runs) for k in range(4)] for p, runs in res.items()}
ref = "server-persistent-sync"
print("| peer | total IOPS | read IOPS | write IOPS | mean latency (µs) | vs server-persistent-sync (median of per-round ratios) | total IOPS per round |")
print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
for p in peers:
    t, rd, wr, lat = med[p]
    ratio = f"{statistics.median(a[0] / b[0] for a, b in zip(res[p], res[ref])):.2f}" if ref in res else "n/a"
    print(f"| {p} | {t:.0f} | {rd:.0f} | {wr:.0f} | {lat:.0f} | {ratio} | {', '.join(str(round(x[0])) for x in res[p])} |")
print()
print(f"Median of {rounds} rounds.")
PYEOF
)
echo
echo "\`bench/server-targets.sh ${args_given}\` — $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, $(fio --version), size=$size runtime=${runtime}s"
echo "load average (1, 5, 15 min) at the start of each round: $(printf '[%s] ' "${loads[@]}")"
echo
echo "$table"
