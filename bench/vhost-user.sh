#!/usr/bin/env bash
# bench/vhost-user.sh — the VDI profile (4 workers x QD16, 4 KiB, 80% writes, 90% random)
# through vhost-user-blk, beside the same cache through the agent's NBD socket, the peer
# qemu-storage-daemon exporting a qcow2 overlay as vhost-user-blk, and the cache engine in
# process; then QD1 latency (1 worker, queue depth 1) of each. One load generator for all:
# `vdstream bench` (vhost-user:PATH drives libblkio's virtio-blk-vhost-user frontend, the
# blkio crate; nbd+unix:// the project's NBD client; in-process:TYPE the engine itself).
#   vhost     vdstream serve-image BASE --read-only  +
#             vdstream target attach vh --server nbd+unix:///?socket=S --cache ram-overflow --ram 2G --vhost-user V
#   nbd       the same attach, benchmarked on its NBD socket
#   qsd       qemu-storage-daemon: overlay.qcow2 (backing BASE) as vhost-user-blk, 4 queues
#   inproc    vdstream bench in-process:ram-overflow (the cache over a zero base in RAM)
# With --threads-ab, also vhost with --vhost-threads 1 (one thread for the 4 queues).
# Each round runs every peer, in a rotated order; caches start empty. Prints IOPS per round,
# the medians and the ratios the issue asks for.
#
# Usage: bench/vhost-user.sh [--size 1g] [--runtime 10] [--rounds 3] [--threads-ab]
# Environment: VDSTREAM_BIN, TMPDIR.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"

size=1g runtime=10 rounds=3 threads_ab=0
while (($#)); do
    case $1 in
    --size) size=$2; shift ;;
    --runtime) runtime=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --threads-ab) threads_ab=1 ;;
    -h | --help) bench_help ;;
    *) bench_bad_arg "$1" ;;
    esac
    shift
done
need_rounds_runtime
need_vdstream
need_cmds qemu-storage-daemon qemu-img nbdinfo
size_bytes=$(numfmt --from=iec "${size^^}")

work=$(mktemp -d "${TMPDIR:-/tmp}/vdstream-vhost-bench.XXXXXX")
server_pid='' agent_pid='' qsd_pid=''
BENCH_PID_VARS="agent_pid server_pid qsd_pid"
bench_cleanup_on_exit
export VDSTREAM_RUN_DIR=$work/run VDSTREAM_CACHE_DIR=$work/cache

base=$work/base.img
echo "making the base image: $size of random data in $work" >&2
head -c "$size_bytes" /dev/urandom >"$base"

# start_agent NAME EXTRA... — the read-only server of BASE and an agent over it with a
# 2 GiB RAM cache, its NBD socket and its vhost-user socket.
start_agent() {
    local name=$1 ssock=$work/server.sock
    shift
    "$VDSTREAM_BIN" serve-image "$base" --socket "$ssock" --read-only >"$work/$name.server.log" 2>&1 </dev/null &
    server_pid=$!
    wait_nbd_ready "$server_pid" "$ssock" "$work/$name.server.log" server 30
    "$VDSTREAM_BIN" target attach vh --server "nbd+unix:///?socket=$ssock" --cache ram-overflow --ram 2G \
        --socket "$work/run/vh.sock" --vhost-user "$work/run/vh.vhost" --vhost-queues 4 "$@" \
        >"$work/$name.agent.log" 2>&1 </dev/null &
    agent_pid=$!
    wait_nbd_ready "$agent_pid" "$work/run/vh.sock" "$work/$name.agent.log" agent 30
}

# run_peer NAME TAG ARGS... — start NAME, run `vdstream bench` with ARGS, stop NAME; the
# result is $work/NAME.TAG.json.
run_peer() {
    local name=$1 tag=$2 uri
    shift 2
    case $name in
    vhost | vhost1t | nbd)
        local extra=()
        [[ $name == vhost1t ]] && extra=(--vhost-threads 1)
        start_agent "$name.$tag" "${extra[@]}"
        if [[ $name == nbd ]]; then uri="nbd+unix:///?socket=$work/run/vh.sock"; else uri="vhost-user:$work/run/vh.vhost"; fi ;;
    qsd)
        rm -f "$work/overlay.qcow2"
        qemu-img create -q -f qcow2 -F raw -b "$base" "$work/overlay.qcow2"
        qemu-storage-daemon \
            --blockdev "driver=file,node-name=file0,filename=$work/overlay.qcow2" \
            --blockdev driver=qcow2,node-name=disk0,file=file0 \
            --export "type=vhost-user-blk,id=exp0,node-name=disk0,addr.type=unix,addr.path=$work/qsd.sock,writable=on,num-queues=4" \
            >"$work/qsd.$tag.log" 2>&1 </dev/null &
        qsd_pid=$!
        for _ in $(seq 100); do [[ -S $work/qsd.sock ]] && break; sleep 0.1; done
        uri="vhost-user:$work/qsd.sock" ;;
    inproc)
        uri="in-process:ram-overflow" ;;
    esac
    local wset=()
    [[ $name == inproc ]] && wset=(--working-set "$size" --ram 2G)
    "$VDSTREAM_BIN" bench "$uri" --profile vdi --duration "$runtime" "${wset[@]}" "$@" --json \
        >"$work/$name.$tag.json" 2>"$work/$name.$tag.bench.log" ||
        { cat "$work/$name.$tag.bench.log" >&2; echo "vdstream bench failed against $name" >&2; exit 1; }
    stop_pid "$agent_pid"; agent_pid=
    stop_pid "$server_pid"; server_pid=
    stop_pid "$qsd_pid"; qsd_pid=
    rm -f "$work/qsd.sock"
    sleep 1
}

peers=(vhost nbd qsd inproc)
((threads_ab)) && peers+=(vhost1t)
for ((r = 0; r < rounds; r++)); do
    n=${#peers[@]}
    order=()
    for ((i = 0; i < n; i++)); do order+=("${peers[(i + r) % n]}"); done
    for p in "${order[@]}"; do
        echo "round $((r + 1))/$rounds: $p (VDI)" >&2
        run_peer "$p" "vdi$r"
        echo "round $((r + 1))/$rounds: $p (QD1)" >&2
        run_peer "$p" "qd1$r" --workers 1 --queue-depth 1
    done
done

"$PY" - "$work" "$rounds" "${peers[@]}" <<'PYEOF'
import json, statistics, sys
work, rounds, peers = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
def load(p, tag):
    return json.load(open(f"{work}/{p}.{tag}.json"))
iops = {p: [load(p, f"vdi{r}")["total"]["iops"] for r in range(rounds)] for p in peers}
lat = {p: [load(p, f"qd1{r}")["total"]["latency"]["mean_us"] for r in range(rounds)] for p in peers}
p50 = {p: [load(p, f"qd1{r}")["total"]["latency"]["p50_us"] for r in range(rounds)] for p in peers}
med = {p: statistics.median(v) for p, v in iops.items()}
print("| peer | VDI IOPS (median) | per round | QD1 mean latency µs (median) | QD1 p50 µs |")
print("|---|---|---|---|---|")
for p in peers:
    print(f"| {p} | {med[p]:.0f} | {', '.join(f'{x:.0f}' for x in iops[p])} | {statistics.median(lat[p]):.1f} | {statistics.median(p50[p]):.1f} |")
def ratio(a, b):
    per = [x / y for x, y in zip(iops[a], iops[b])]
    return f"{statistics.median(per):.2f} (rounds {', '.join(f'{x:.2f}' for x in per)})"
print()
print(f"vhost / nbd:    {ratio('vhost', 'nbd')}   goal >= 3")
print(f"vhost / inproc: {ratio('vhost', 'inproc')}   goal >= 0.5")
print(f"vhost / qsd:    {ratio('vhost', 'qsd')}   goal >= 1.5")
if "vhost1t" in peers:
    print(f"vhost (thread per queue) / vhost (one thread): {ratio('vhost', 'vhost1t')}")
PYEOF
