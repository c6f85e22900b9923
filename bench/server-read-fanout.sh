#!/usr/bin/env bash
# bench/server-read-fanout.sh — many targets reading one vDisk at once (a boot storm's
# reads), through their agents, from one store server: what the guests read against what
# reached the store, with and without the server's shared read cache.
#
# One vDisk of --size random data in a fresh store (base only). For each configuration:
#   cache-on   vdstream server --read-cache CACHE-SIZE    (default 1536M: the vDisk fits)
#   cache-off  vdstream server --read-cache 0
# the server starts with --stats-file, --agents agents attach to vdisk/golden
# (`vdstream target attach tN --cache ram-overflow --ram 64M`), then every agent's guest
# reads the whole vDisk at the same moment (`nbdcopy --no-extents -C 1 AGENT null:`, one
# per agent). Reported per round: wall time from the first reader's start to the last
# reader's end, guest reads (the sum over agents of what their readers asked), what the
# agents asked the server, the server's store reads (what reached the layer files) and its
# read cache's hits, misses and shared loads. Configurations alternate between rounds.
#
# The counts are exact; the time is not a server figure on a 2-core machine: the agents,
# the readers and the server (2N+1 busy processes) share the cores, and the store's file
# sits in the page cache in both configurations (only the copy out of it is saved).
#
# Usage: bench/server-read-fanout.sh [--size 1g] [--agents 16] [--rounds 2]
#                                    [--cache-size 1536M]
# Environment: VDSTREAM_BIN, TMPDIR.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"

size=1g agents=16 rounds=2 cache_size=1536M
args_given="$*"
while (($#)); do
    case $1 in
    --size) size=$2; shift ;;
    --agents) agents=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --cache-size) cache_size=$2; shift ;;
    -h | --help) bench_help ;;
    *) bench_bad_arg "$1" ;;
    esac
    shift
done
need_vdstream
command -v nbdcopy >/dev/null || { echo "server-read-fanout.sh: nbdcopy not found (apt-get install libnbd-bin)" >&2; exit 2; }
((agents >= 1 && agents <= 64)) || { echo "server-read-fanout.sh: --agents must be 1..64" >&2; exit 2; }
size_bytes=$(numfmt --from=iec "${size^^}")

work=$(mktemp -d "${TMPDIR:-/tmp}/vdstream-server-fanout.XXXXXX")
server_pid=''
agent_pids=()
reader_pids=()
stop_agents() {
    local p
    for p in "${reader_pids[@]}" "${agent_pids[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
    for p in "${reader_pids[@]}" "${agent_pids[@]}"; do stop_pid "$p" 100; done
    reader_pids=() agent_pids=()
}
_fanout_cleanup() {
    local rc=$?
    stop_agents
    stop_pid "$server_pid" 50
    rm -rf "$work"
    exit "$rc"
}
trap _fanout_cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
export VDSTREAM_STORE=$work/store VDSTREAM_CACHE_DIR=$work/cache

echo "making the vDisk: $size of random data in $work/store" >&2
head -c "$size_bytes" /dev/urandom >"$work/golden.img"
"$VDSTREAM_BIN" vdisk import golden "$work/golden.img" >/dev/null
rm -f "$work/golden.img"

# run_config NAME ROUND — server, agents, readers at once; leaves NAME.ROUND.{stats,time}
# and the agents' status files in $work/NAME.ROUND.run/.
run_config() {
    local name=$1 r=$2 ssock=$work/server.sock rc=0 i t0 t1 p
    local run=$work/$name.$r.run
    local cache_arg=$cache_size
    [[ $name == cache-off ]] && cache_arg=0
    mkdir -p "$run"
    "$VDSTREAM_BIN" server --socket "$ssock" --read-cache "$cache_arg" --stats-file "$work/$name.$r.stats.json" \
        >"$work/$name.$r.server.log" 2>&1 </dev/null &
    server_pid=$!
    for _ in $(seq 300); do [[ -S $ssock ]] && break; sleep 0.1; done
    [[ -S $ssock ]] || { cat "$work/$name.$r.server.log" >&2; echo "the server did not start" >&2; exit 1; }
    for ((i = 0; i < agents; i++)); do
        VDSTREAM_RUN_DIR=$run "$VDSTREAM_BIN" target attach "t$i" --server "nbd+unix:///vdisk/golden?socket=$ssock" \
            --cache ram-overflow --ram 64M >"$run/t$i.log" 2>&1 </dev/null &
        agent_pids+=($!)
    done
    for ((i = 0; i < agents; i++)); do
        wait_nbd_ready "${agent_pids[i]}" "$run/t$i.sock" "$run/t$i.log" "agent t$i" 60
    done
    t0=$(date +%s.%N)
    for ((i = 0; i < agents; i++)); do
        timeout 600 nbdcopy --no-extents -C 1 "nbd+unix:///?socket=$run/t$i.sock" null: 2>"$run/t$i.nbdcopy.log" &
        reader_pids+=($!)
    done
    for p in "${reader_pids[@]}"; do wait "$p" || rc=1; done
    t1=$(date +%s.%N)
    reader_pids=()
    ((rc == 0)) || { cat "$run"/*.nbdcopy.log >&2; echo "a reader failed ($name)" >&2; exit 1; }
    echo "$t0 $t1" >"$work/$name.$r.time"
    stop_agents
    stop_pid "$server_pid"; server_pid=
    sleep 1
}

loads=()
for ((r = 0; r < rounds; r++)); do
    if ((r % 2 == 0)); then order=(cache-on cache-off); else order=(cache-off cache-on); fi
    for c in "${order[@]}"; do
        loads+=("$(cut -d' ' -f1-3 /proc/loadavg)")
        echo "round $((r + 1))/$rounds: $c" >&2
        run_config "$c" "$r"
    done
done

table=$("$PY" - "$work" "$rounds" "$agents" "$size_bytes" <<'PYEOF'
import glob, json, statistics, sys
work, rounds, agents, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
MiB = 1 << 20
rows = {}
for name in ("cache-on", "cache-off"):
    for r in range(rounds):
        t0, t1 = map(float, open(f"{work}/{name}.{r}.time").read().split())
        guest = to_server = 0
        for f in glob.glob(f"{work}/{name}.{r}.run/*.status.json"):
            s = json.load(open(f))
            assert s["state"] == "stopped", f"{f}: agent did not stop cleanly"
            guest += s["guest"]["read_bytes"]
            to_server += s["server"]["read_bytes"]
        st = json.load(open(f"{work}/{name}.{r}.stats.json"))
        t, c = st["totals"], st["read_cache"]
        rows.setdefault(name, []).append(dict(secs=t1 - t0, guest=guest, to_server=to_server,
            srv_guest=t["guest_read_bytes"], store=t["store_read_bytes"], hits=c.get("hits"),
            misses=c.get("misses"), shared=c.get("shared_loads")))
print("| server | round | wall time (s) | guest reads, sum over agents (MiB) | agents' reads of the server (MiB) | store reads (MiB) | store reads / vDisk size | guest / store | cache hits | misses | shared loads | guest MiB/s |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for name, runs in rows.items():
    for r, x in enumerate(runs):
        print(f"| {name} | {r + 1} | {x['secs']:.1f} | {x['guest'] / MiB:.0f} | {x['to_server'] / MiB:.0f} | {x['store'] / MiB:.0f} | "
              f"{x['store'] / size:.2f} | {x['guest'] / max(1, x['store']):.1f} | {x['hits']} | {x['misses']} | {x['shared']} | {x['guest'] / MiB / x['secs']:.0f} |")
on = statistics.median(x["secs"] for x in rows["cache-on"])
off = statistics.median(x["secs"] for x in rows["cache-off"])
per = [a["secs"] / b["secs"] for a, b in zip(rows["cache-on"], rows["cache-off"])]
print()
print(f"Median wall time: cache on {on:.1f} s, cache off {off:.1f} s; on/off per round {', '.join(f'{x:.2f}' for x in per)} "
      f"(median {statistics.median(per):.2f}).")
PYEOF
)
echo
echo "\`bench/server-read-fanout.sh ${args_given}\` — $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, $agents agents, size=$size, cache on = --read-cache $cache_size"
echo "load average (1, 5, 15 min) at the start of each run: $(printf '[%s] ' "${loads[@]}")"
echo
echo "$table"
