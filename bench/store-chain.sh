#!/usr/bin/env bash
# bench/store-chain.sh — reads through a vDisk version chain over NBD (unix sockets),
# one peer after the other on the same machine:
#   vdstream-chain   vdstream serve-image vN.qcow2 --format qcow2 --read-only (base + N qcow2 versions)
#   vdstream-flat    vdstream serve-image flat.qcow2 --read-only (the chain flattened by
#                    qemu-img convert: what reads would cost without versions)
#   qemu-nbd-chain   qemu-nbd -r -f qcow2 -t -e 8 --cache=writeback --aio=threads vN.qcow2
#                    (qemu-nbd's own defaults for cache and aio spelled out: both servers
#                    read through the host page cache; --cache=none would make qemu-nbd
#                    pay O_DIRECT reads that vdstream does not)
#   qemu-nbd-flat    (only with --peers) the same on flat.qcow2
# Workloads (fio, ioengine=nbd, one connection per job, time based):
#   seqread   1 MiB sequential reads, 4 jobs x iodepth 16, each job its own quarter
#   randread  4 KiB random reads over the whole disk, 4 jobs x iodepth 16
# The chain (bench/lib.sh make_store_chain): a base of SIZE random data, then N versions,
# each with PCT% of the disk in random 64 KiB writes. Every file is read once before
# the rounds, so all peers read from a warm page cache (this measures the servers, not
# the disk). With --rounds R each peer runs R times, the order rotating every round; the
# median is shown with the per-round values and the ratio to qemu-nbd-chain.
#
# Usage: bench/store-chain.sh [--size-mib 1024] [--layers 5] [--pct 10] [--runtime 10]
#                             [--rounds 3] [--quick] [--out FILE] [--peers a,b,...]
#   --quick     --size-mib 128 --runtime 2 --rounds 1 (to check the script)
# Environment: VDSTREAM_BIN (default target/release/vdstream).

set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"

mib=1024 layers=5 pct=10 runtime=10 rounds=3 out='' peers=vdstream-chain,vdstream-flat,qemu-nbd-chain
args_given="$*"
while (($#)); do
    case $1 in
    --size-mib) mib=$2; shift ;;
    --layers) layers=$2; shift ;;
    --pct) pct=$2; shift ;;
    --runtime) runtime=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --quick) mib=128 runtime=2 rounds=1 ;;
    --out) out=$2; shift ;;
    --peers) peers=$2; shift ;;
    -h | --help) bench_help ;;
    *) bench_bad_arg "$1" ;;
    esac
    shift
done
for v in mib layers pct runtime rounds; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || { echo "--${v} must be a positive integer" >&2; exit 2; }
done
((mib % 4 == 0)) || { echo "--size-mib must be a multiple of 4" >&2; exit 2; }
need_cmds fio qemu-img qemu-io qemu-nbd nbdinfo
need_vdstream
IFS=, read -r -a peer_list <<<"$peers"

work=$(mktemp -d "${TMPDIR:-/tmp}/vdstream-bench-chain.XXXXXX")
server_pid=
bench_cleanup_on_exit

echo "building the chain: ${mib} MiB base + $layers versions of ${pct}% 64 KiB writes" >&2
make_store_chain "$work" "$mib" "$layers" "$pct"
top=$work/v$layers.qcow2
qemu-img convert -O qcow2 "$top" "$work/flat.qcow2"
cat "$work"/*.qcow2 >/dev/null

# start_peer NAME SOCK — start the peer's server on SOCK; sets server_pid.
start_peer() {
    local name=$1 sock=$2 cmd
    case $name in
    vdstream-chain) cmd=("$VDSTREAM_BIN" serve-image "$top" --format qcow2 --read-only --socket "$sock") ;;
    vdstream-flat) cmd=("$VDSTREAM_BIN" serve-image "$work/flat.qcow2" --read-only --socket "$sock") ;;
    qemu-nbd-chain) cmd=(qemu-nbd -r -f qcow2 -t -e 8 --cache=writeback --aio=threads --socket="$sock" "$top") ;;
    qemu-nbd-flat) cmd=(qemu-nbd -r -f qcow2 -t -e 8 --cache=writeback --aio=threads --socket="$sock" "$work/flat.qcow2") ;;
    *) echo "unknown peer $name" >&2; return 1 ;;
    esac
    "${cmd[@]}" >"$work/$name.server.log" 2>&1 </dev/null &
    server_pid=$!
    wait_nbd_ready "$server_pid" "$sock" "$work/$name.server.log" "$name" 20
}

# run_fio WORKLOAD URI OUT — one bounded fio run.
run_fio() {
    local wl=$1 uri=$2 json=$3 quarter=$((mib / 4)) shape
    case $wl in
    seqread) shape=(--rw=read --bs=1M --size="${quarter}M" --offset_increment="${quarter}M") ;;
    randread) shape=(--rw=randread --bs=4k --size="${mib}M") ;;
    esac
    timeout --kill-after=10 $((runtime + 60)) fio --name="$wl" --ioengine=nbd --uri="$uri" \
        "${shape[@]}" --iodepth=16 --numjobs=4 --group_reporting \
        --time_based --runtime="$runtime" --output-format=json --output="$json" >"$json.log" 2>&1
}

n=${#peer_list[@]}
for ((r = 0; r < rounds; r++)); do
    for ((k = 0; k < n; k++)); do
        p=${peer_list[(k + r) % n]}
        sock=$work/$p.$r.sock
        start_peer "$p" "$sock" || { echo "failed to start $p" >&2; exit 1; }
        for wl in seqread randread; do
            echo "round $((r + 1))/$rounds: $p $wl (${runtime}s)" >&2
            run_fio "$wl" "nbd+unix:///?socket=$sock" "$work/$p.$wl.$r.json" ||
                { cat "$work/$p.$wl.$r.json.log" >&2; echo "fio failed against $p" >&2; exit 1; }
        done
        stop_pid "$server_pid"
        server_pid=
        sleep 1
    done
done

table=$("$PY" - "$work" "$rounds" "${peer_list[@]}" <<'PYEOF'
import json, statistics, sys
work, rounds, peers = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
ref = "qemu-nbd-chain"

def load(path):
    text = open(path).read()
    j = json.loads(text[text.index("{"):])
    job = j["jobs"][0]
    if job["error"]:
        sys.exit(f"fio reported error {job['error']} in {path}")
    r = job["read"]
    return {"iops": r["iops"], "mbs": r["bw_bytes"] / 1e6, "lat": r["lat_ns"]["mean"] / 1000}

for wl, unit in (("seqread", "mbs"), ("randread", "iops")):
    res = {}
    for p in peers:
        runs = [load(f"{work}/{p}.{wl}.{i}.json") for i in range(rounds)]
        res[p] = {k: statistics.median(x[k] for x in runs) for k in ("iops", "mbs", "lat")}
        res[p]["runs"] = [round(x[unit]) for x in runs]
    name = "MB/s" if unit == "mbs" else "IOPS"
    what = "1 MiB sequential reads" if wl == "seqread" else "4 KiB random reads"
    print(f"**{wl}** ({what}, 4 jobs x iodepth 16)\n")
    print(f"| peer | {name} (median) | mean latency (µs) | vs {ref} | per round |")
    print("| --- | ---: | ---: | ---: | --- |")
    for p in peers:
        x = res[p]
        ratio = f"{x[unit] / res[ref][unit]:.2f}" if ref in res else "n/a"
        print(f"| {p} | {x[unit]:.0f} | {x['lat']:.0f} | {ratio} | {x['runs']} |")
    print()
PYEOF
)

header="### Reads through a version chain over NBD

\`bench/store-chain.sh ${args_given}\` — $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, $(fio --version),
$(qemu-nbd --version | head -n1); chain: ${mib} MiB random base (qcow2) + $layers qcow2 versions
of ${pct}% random 64 KiB writes each; flat = \`qemu-img convert -O qcow2\` of the chain; page cache
warm; ${runtime}s per run; median of $rounds round(s), order rotating.
"
printf '%s\n%s\n' "$header" "$table"
if [[ -n $out ]]; then
    printf '%s\n%s\n' "$header" "$table" >"$out"
    echo "wrote $out" >&2
fi
