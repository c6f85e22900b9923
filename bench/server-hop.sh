#!/usr/bin/env bash
# bench/server-hop.sh — the cost of the agent hop in front of the store server, under the
# VDI profile (shared/bench/vdi.fio: 4 jobs x QD16, 4 KiB, 80% writes, 90% random), fio's
# nbd engine over unix sockets. One vDisk of --size random data in a fresh store (base
# only, so production targets get the base); for each cache type TYPE in --caches:
#   direct-TYPE  vdstream serve-image --vdisk NAME --cache TYPE            (no hop: the cache
#                in the process fio talks to, reading the store's file itself)
#   agent-TYPE   vdstream server --store STORE  +
#                vdstream target attach hop --server nbd+unix:///vdisk/NAME?socket=S --cache TYPE
#                (fio talks to the agent; the agent reads the vDisk from the server over NBD)
# For the server-side types (server, server-persistent) the cache is in the server:
#   direct-TYPE  vdstream serve-image --vdisk NAME --cache TYPE
#   agent-TYPE   vdstream server --store STORE (a target record T of that type)  +
#                vdstream target attach T --server nbd+unix:///target/T?socket=S --cache TYPE
#                (the agent forwards writes; for server-persistent it journals the answered
#                ones until a flush covers them, and the server answers without a sync each)
#   agent-server-persistent-sync
#                the same with --journal-max 0: no journal, so the server makes every write
#                durable before answering it (write-through); with server-persistent in
#                --caches the table also gives agent-server-persistent against it
# RAM caches get --ram 2G (the whole working set fits). Each round runs every peer, the
# order rotating between rounds; caches start empty. Prints total IOPS per round, the
# medians, agent/direct per cache type and per round, and the load average.
#
# Usage: bench/server-hop.sh [--size 1g] [--runtime 15] [--rounds 3]
#                            [--caches ram-overflow,device-disk,server,server-persistent]
# Environment: SHARED (default: the `shared` folder beside the repo), VDSTREAM_BIN, TMPDIR.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"

size=1g runtime=15 rounds=3 caches=ram-overflow,device-disk
args_given="$*"
while (($#)); do
    case $1 in
    --size) size=$2; shift ;;
    --runtime) runtime=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --caches) caches=$2; shift ;;
    -h | --help) bench_help ;;
    *) bench_bad_arg "$1" ;;
    esac
    shift
done
need_jobfile
need_vdstream
size_bytes=$(numfmt --from=iec "${size^^}")
IFS=, read -r -a cache_types <<<"$caches"
peers=()
for c in "${cache_types[@]}"; do
    case $c in
    ram-overflow | device-ram | device-disk | device-disk-persistent | server) peers+=("direct-$c" "agent-$c") ;;
    server-persistent) peers+=("direct-$c" "agent-$c" "agent-$c-sync") ;;
    *) echo "server-hop.sh: --caches takes ram-overflow, device-ram, device-disk, device-disk-persistent, server or server-persistent, not $c" >&2; exit 2 ;;
    esac
done

work=$(mktemp -d "${TMPDIR:-/tmp}/vdstream-server-hop.XXXXXX")
server_pid='' agent_pid=''
BENCH_PID_VARS="agent_pid server_pid"
bench_cleanup_on_exit
export VDSTREAM_RUN_DIR=$work/run VDSTREAM_CACHE_DIR=$work/cache VDSTREAM_STORE=$work/store

echo "making the vDisk: $size of random data in $work/store" >&2
head -c "$size_bytes" /dev/urandom >"$work/golden.img"
"$VDSTREAM_BIN" vdisk import golden "$work/golden.img" >/dev/null
rm -f "$work/golden.img"
# Target records for the server-side types (the agent reads target/hop-TYPE).
for c in "${cache_types[@]}"; do
    case $c in server | server-persistent)
        "$VDSTREAM_BIN" target add "hop-$c" --vdisk golden --cache "$c" >/dev/null ;;
    esac
done

# ram_args TYPE — the --ram flag for RAM cache types.
ram_args() {
    case $1 in ram-overflow | device-ram) echo "--ram 2G" ;; esac
}

# run_peer NAME ROUND — start the peer, run fio against it, stop it.
run_peer() {
    local name=$1 r=$2 ssock=$work/server.sock uri cache=${1#*-} extra export=vdisk/golden id=hop
    if [[ $cache == *-sync ]]; then
        cache=${cache%-sync}
        extra=(--journal-max 0)
    else
        read -r -a extra <<<"$(ram_args "$cache")"
    fi
    case $cache in server | server-persistent) id=hop-$cache export=target/hop-$cache ;; esac
    mkdir -p "$work/cache"
    case $name in
    direct-*)
        "$VDSTREAM_BIN" serve-image --vdisk golden --socket "$ssock" --cache "$cache" "${extra[@]}" \
            --overflow-dir "$work/cache" >"$work/$name.$r.server.log" 2>&1 </dev/null &
        server_pid=$!
        wait_nbd_ready "$server_pid" "$ssock" "$work/$name.$r.server.log" serve-image 60
        uri="nbd+unix:///?socket=$ssock" ;;
    agent-*)
        "$VDSTREAM_BIN" server --socket "$ssock" --stats-file "$work/$name.$r.stats.json" \
            >"$work/$name.$r.server.log" 2>&1 </dev/null &
        server_pid=$!
        # The server answers only named exports: wait for its socket, then for the agent.
        for _ in $(seq 300); do [[ -S $ssock ]] && break; sleep 0.1; done
        "$VDSTREAM_BIN" target attach "$id" --server "nbd+unix:///$export?socket=$ssock" \
            --cache "$cache" "${extra[@]}" >"$work/$name.$r.agent.log" 2>&1 </dev/null &
        agent_pid=$!
        wait_nbd_ready "$agent_pid" "$work/run/$id.sock" "$work/$name.$r.agent.log" agent 60
        uri="nbd+unix:///?socket=$work/run/$id.sock" ;;
    esac
    fio "$JOBFILE" --ioengine=nbd --uri="$uri" --size="$size" --runtime="$runtime" \
        --output-format=json --output="$work/$name.$r.json" >"$work/$name.$r.fio.log" 2>&1 ||
        { cat "$work/$name.$r.fio.log" >&2; echo "fio failed against $name" >&2; exit 1; }
    stop_pid "$agent_pid"; agent_pid=
    stop_pid "$server_pid"; server_pid=
    rm -rf "$work/cache" "$work/run" "$work/store/cache"
    sleep 1
}

loads=()
for ((r = 0; r < rounds; r++)); do
    # Rotate the order: each peer takes each position in turn.
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
print("| path | total IOPS | read IOPS | write IOPS | mean latency (µs) | agent / direct (median of per-round ratios) | total IOPS per round |")
print("| --- | ---: | ---: | ---: | ---: | ---: | --- |")
notes = []
for p in peers:
    kind, cache = p.split("-", 1)
    if kind == "direct":
        label, ratio = f"fio → `serve-image --vdisk golden --cache {cache}`", "1.00"
    else:
        sync = cache.endswith("-sync")
        base = cache.removesuffix("-sync")
        label = f"fio → agent `--cache {base}{' --journal-max 0' if sync else ''}` → `vdstream server`"
        per = [a[0] / d[0] for a, d in zip(res[p], res[f"direct-{base}"])]
        ratio = f"**{statistics.median(per):.2f}**"
        notes.append(f"{cache}: agent/direct per round {', '.join(f'{x:.2f}' for x in per)}")
        if not sync and f"agent-{cache}-sync" in res:
            j = [a[0] / b[0] for a, b in zip(res[p], res[f"agent-{cache}-sync"])]
            notes.append(f"{cache}: the journal against write-through (agent-{cache} / agent-{cache}-sync) per round "
                         f"{', '.join(f'{x:.2f}' for x in j)}, median {statistics.median(j):.2f}")
    t, rd, wr, lat = med[p]
    print(f"| {label} | {t:.0f} | {rd:.0f} | {wr:.0f} | {lat:.0f} | {ratio} | {', '.join(str(round(x[0])) for x in res[p])} |")
print()
print(f"Median of {rounds} rounds; " + "; ".join(notes) + ".")
PYEOF
)
store_reads=$("$PY" - "$work" "$rounds" "${peers[@]}" <<'PYEOF'
import json, sys, os
work, rounds, peers = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
out = []
for p in peers:
    if not p.startswith("agent-"):
        continue
    vals = []
    for i in range(rounds):
        f = f"{work}/{p}.{i}.stats.json"
        if os.path.exists(f):
            t = json.load(open(f))["totals"]
            vals.append(f"{t['guest_read_ops']} reads / {t['guest_read_bytes'] >> 20} MiB")
    out.append(f"{p}: server's guest reads per round: {', '.join(vals)}")
print("; ".join(out))
PYEOF
)
echo
echo "\`bench/server-hop.sh ${args_given}\` — $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, $(fio --version), size=$size runtime=${runtime}s"
echo "load average (1, 5, 15 min) at the start of each round: $(printf '[%s] ' "${loads[@]}")"
echo
echo "$table"
echo
echo "$store_reads"
