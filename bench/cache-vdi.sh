#!/usr/bin/env bash
# bench/cache-vdi.sh — the write caches under the VDI profile (shared/bench/vdi.fio: 4 jobs x
# QD16, 4 KiB, 80% writes, 90% random), fio's nbd engine over unix sockets, every peer on
# the same base image (a raw file of --size full of random data, in a scratch dir under
# ${TMPDIR:-/tmp}, on the same file system as the cache files), one after the other:
#   raw-disk            fio --ioengine=io_uring --direct=1 on a scratch copy of the base
#                       (no NBD, no cache: the disk's ceiling for this job file)
#   raw-disk-buf        the same with --direct=0 (through the page cache: device-disk-buf's peer)
#   raw-disk-nbd        qemu-nbd -f raw --cache=none --aio=io_uring on a scratch copy of the base
#                       (the raw disk with the same flags, served over the same socket: no cache)
#   nbdkit-null         nbdkit null size=SIZE (a server that stores nothing: what fio's nbd
#                       engine and the socket alone allow on this machine)
#   raw-disk-inproc     the same profile in process, no fio: 4 threads, each handing its 16
#                       requests to the O_DIRECT file as one io_uring batch
#                       (crates/wcache/benches/disk_vdi.rs: this harness's own ceiling)
#   device-disk-inproc  device-disk's engine in process under that harness (no NBD, no socket:
#                       what the cache layer costs against the raw disk)
#   device-disk-inproc-base-direct
#                       the same, reading the base with O_DIRECT too (pages not written yet
#                       get no help from the page cache)
#   device-disk         vdstream serve-image BASE --cache device-disk          (O_DIRECT, chunks zero-filled, batched io_uring)
#   device-disk-uring   ... --cache device-disk --io-engine io_uring           (O_DIRECT, the shared ring for requests outside batches)
#   device-disk-sparse  ... --cache device-disk --zero-fill off                (O_DIRECT, chunks only fallocated)
#   device-disk-buf     ... --cache device-disk --intermediate-buffering on    (page cache)
#   ram-overflow-2g     ... --cache ram-overflow --ram 2G                      (everything fits)
#   ram-overflow-64m    ... --cache ram-overflow --ram 64M                     (overflows: working set = --size)
#   device-ram-2g       ... --cache device-ram --ram 2G
#   ram-overflow-2g-trace, ram-overflow-64m-trace
#                       ... the same, with --record-trace FILE in the scratch dir (the cost of
#                       recording; the footer gives each one's ratio to its untraced peer)
#   server              ... --cache server                                     (device-disk's engine)
#   nbdkit-cow          nbdkit --filter=cow file BASE  (overlay in the scratch dir, default 64K cow blocks)
#   qemu-nbd-qcow2      qemu-img create -f qcow2 -b BASE -F raw ovl.qcow2;
#                       qemu-nbd -k SOCK -t -e 8 -f qcow2 --cache=none --aio=io_uring ovl.qcow2
# Every cache starts empty. The table shows total/read/write IOPS, mean completion latency,
# storage writes per guest write (bytes the server process sent towards storage, from
# /proc/PID/io write_bytes - cancelled_write_bytes, over the bytes fio wrote; buffered
# writes count once per page dirtied, so rewrites of a page still dirty are not counted),
# and total IOPS relative to raw-disk and to device-disk. With --rounds N each peer runs N
# times, the order rotating every round, and the median is shown.
#
# Usage: bench/cache-vdi.sh [--size 1g] [--runtime 20] [--rounds 1] [--quick] [--out FILE]
#                           [--peers LIST] [--keep DIR]
#   --quick       --size 256m --runtime 3 (to check the script, not for figures)
#   --peers LIST  comma-separated subset of the peers above (default: all)
#   --out FILE    also write the table (with the command line and environment) to FILE
#   --keep DIR    keep fio's JSON output of every run in DIR
# Environment: SHARED (default: the `shared` folder beside the repo), VDSTREAM_BIN, TMPDIR.

set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"
ALL_PEERS=raw-disk,raw-disk-buf,raw-disk-inproc,device-disk-inproc,device-disk-inproc-base-direct,raw-disk-nbd,nbdkit-null,device-disk,device-disk-uring,device-disk-sparse,device-disk-buf,ram-overflow-2g,ram-overflow-64m,device-ram-2g,server,nbdkit-cow,qemu-nbd-qcow2,ram-overflow-2g-trace,ram-overflow-64m-trace

size=1g runtime=20 rounds=1 out='' keep='' peers=$ALL_PEERS
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
size_bytes=$(numfmt --from=iec "${size^^}") || { echo "--size: cannot parse $size" >&2; exit 2; }
((size_bytes >= 16 << 20 && size_bytes % 4096 == 0)) || { echo "--size must be >= 16m and a multiple of 4k" >&2; exit 2; }
IFS=, read -r -a peer_list <<<"$peers"
for p in "${peer_list[@]}"; do
    [[ ,$ALL_PEERS, == *,"$p",* ]] || { echo "cache-vdi.sh: unknown peer $p (choose from $ALL_PEERS)" >&2; exit 2; }
done
need=(fio nbdinfo numfmt)
for p in "${peer_list[@]}"; do
    case $p in nbdkit-cow | nbdkit-null) need+=(nbdkit) ;; qemu-nbd-qcow2) need+=(qemu-nbd qemu-img) ;; raw-disk-nbd) need+=(qemu-nbd) ;; esac
done
need_cmds "${need[@]}"
if ((size_bytes < 96 << 20)) && [[ ,$peers, == *,ram-overflow-64m,* ]]; then
    echo "note: --size $size is below 1.5 x 64M: ram-overflow-64m will hardly overflow" >&2
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/vdstream-cache-bench.XXXXXX")
server_pid=
bench_cleanup_on_exit

IB_ON=(--intermediate-buffering on)

base=$work/base.img
echo "making the base image: $size of random data in $work" >&2
head -c "$size_bytes" /dev/urandom >"$base"

# copy_base DIR — a copy of the base in DIR, on disk before the run (the raw-disk peers
# write to it); prints its path.
copy_base() {
    cp "$base" "$1/basecopy.img"
    sync
    echo "$1/basecopy.img"
}

# start_peer NAME SOCK CACHEDIR — start the peer's server on SOCK; sets server_pid.
start_peer() {
    local name=$1 sock=$2 cdir=$3 cmd env=()
    local vd=("$VDSTREAM_BIN" serve-image "$base" --socket "$sock" --overflow-dir "$cdir")
    case $name in
    device-disk) cmd=("${vd[@]}" --cache device-disk) ;;
    device-disk-uring) cmd=("${vd[@]}" --cache device-disk --io-engine io_uring) ;;
    device-disk-sparse) cmd=("${vd[@]}" --cache device-disk --zero-fill off) ;;
    device-disk-buf) cmd=("${vd[@]}" --cache device-disk "${IB_ON[@]}") ;;
    ram-overflow-2g) cmd=("${vd[@]}" --cache ram-overflow --ram 2G) ;;
    ram-overflow-64m) cmd=("${vd[@]}" --cache ram-overflow --ram 64M) ;;
    ram-overflow-2g-trace) cmd=("${vd[@]}" --cache ram-overflow --ram 2G --record-trace "$cdir/io.trace") ;;
    ram-overflow-64m-trace) cmd=("${vd[@]}" --cache ram-overflow --ram 64M --record-trace "$cdir/io.trace") ;;
    device-ram-2g) cmd=("${vd[@]}" --cache device-ram --ram 2G) ;;
    server) cmd=("${vd[@]}" --cache server) ;;
    nbdkit-cow) env=(TMPDIR="$cdir"); cmd=(nbdkit -f -U "$sock" --filter=cow file "$base") ;;
    nbdkit-null) cmd=(nbdkit -f -U "$sock" null size="$size_bytes") ;;
    raw-disk-nbd)
        cmd=(qemu-nbd -k "$sock" -t -e 8 -f raw --cache=none --aio=io_uring "$(copy_base "$cdir")") ;;
    qemu-nbd-qcow2)
        qemu-img create -q -f qcow2 -b "$base" -F raw "$cdir/ovl.qcow2"
        cmd=(qemu-nbd -k "$sock" -t -e 8 -f qcow2 --cache=none --aio=io_uring "$cdir/ovl.qcow2") ;;
    *) echo "unknown peer $name" >&2; return 1 ;;
    esac
    env "${env[@]}" "${cmd[@]}" >"$work/$name.server.log" 2>&1 </dev/null &
    server_pid=$!
    wait_nbd_ready "$server_pid" "$sock" "$work/$name.server.log" "$name" 30
}

stop_peer() {
    stop_pid "$server_pid"
    server_pid=
}

# proc_written PID — bytes PID sent towards storage so far.
proc_written() {
    awk '/^write_bytes/ {w = $2} /^cancelled_write_bytes/ {c = $2} END {printf "%.0f\n", w - c}' "/proc/$1/io"
}

available=()
for p in "${peer_list[@]}"; do
    case $p in
    raw-disk | raw-disk-buf | raw-disk-nbd | nbdkit-null | nbdkit-cow | qemu-nbd-qcow2) ;;
    *-inproc | *-inproc-*)
        if [[ -z ${INPROC_BIN:-} ]]; then
            echo "building the in-process harness (cargo bench -p vdstream-wcache --bench disk_vdi)" >&2
            INPROC_BIN=$(cd "$ROOT" && cargo bench -q -p vdstream-wcache --bench disk_vdi --no-run --message-format=json 2>/dev/null |
                "$PY" -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "disk_vdi":
        print(m["executable"])') || true
        fi
        if [[ ! -x ${INPROC_BIN:-} ]]; then
            echo "note: the in-process harness did not build: skipping $p" >&2
            continue
        fi ;;
    *) if [[ ! -x $VDSTREAM_BIN ]]; then
           echo "note: $VDSTREAM_BIN not built (cargo build --release): skipping $p" >&2
           continue
       fi ;;
    esac
    available+=("$p")
done
((${#available[@]})) || { echo "no peer to run" >&2; exit 1; }

n=${#available[@]}
for ((r = 0; r < rounds; r++)); do
    for ((k = 0; k < n; k++)); do
        p=${available[(k + r) % n]}
        echo "round $((r + 1))/$rounds: $p (size=$size runtime=${runtime}s)" >&2
        cdir=$work/cache.$p.$r
        mkdir -p "$cdir"
        json=$work/$p.$r.json
        if [[ $p == raw-disk || $p == raw-disk-buf ]]; then
            direct=1
            [[ $p == raw-disk-buf ]] && direct=0
            copy=$(copy_base "$cdir")
            fio "$JOBFILE" --ioengine=io_uring --direct=$direct --filename="$copy" \
                --size="$size" --runtime="$runtime" \
                --output-format=json --output="$json" >"$work/$p.$r.fio.log" 2>&1 ||
                { cat "$work/$p.$r.fio.log" "$json" >&2 || true; echo "fio failed on $p" >&2; exit 1; }
            echo "-1" >"$work/$p.$r.storage"
        elif [[ $p == *-inproc || $p == *-inproc-* ]]; then
            if [[ $p == raw-disk-inproc ]]; then
                inproc=(--device raw-disk --base "$(copy_base "$cdir")")
                echo "-1" >"$work/$p.$r.storage"
            else
                inproc=(--device "${p%%-inproc*}" --base "$base" --dir "$cdir" --storage-out "$work/$p.$r.storage")
                [[ $p != *-base-direct ]] || inproc+=(--base-direct)
            fi
            "$INPROC_BIN" "${inproc[@]}" --runtime "$runtime" >"$json" 2>"$work/$p.$r.fio.log" ||
                { cat "$work/$p.$r.fio.log" "$json" >&2 || true; echo "the in-process harness failed on $p" >&2; exit 1; }
        else
            sock=$work/$p.$r.sock
            start_peer "$p" "$sock" "$cdir" || { echo "failed to start $p" >&2; exit 1; }
            w0=$(proc_written "$server_pid")
            fio "$JOBFILE" --ioengine=nbd --uri="nbd+unix:///?socket=$sock" \
                --size="$size" --runtime="$runtime" \
                --output-format=json --output="$json" >"$work/$p.$r.fio.log" 2>&1 ||
                { cat "$work/$p.$r.fio.log" "$json" >&2 || true; echo "fio failed against $p" >&2; exit 1; }
            echo $(($(proc_written "$server_pid") - w0)) >"$work/$p.$r.storage"
            stop_peer
        fi
        rm -rf "$cdir"
        sleep 1
    done
done
if [[ -n $keep ]]; then mkdir -p "$keep" && cp "$work"/*.json "$keep"/; fi

table=$("$PY" - "$work" "$rounds" "${available[@]}" <<'PYEOF'
import json, statistics, sys
work, rounds, peers = sys.argv[1], int(sys.argv[2]), sys.argv[3:]

def load(p, i):
    text = open(f"{work}/{p}.{i}.json").read()
    j = json.loads(text[text.index("{"):])   # fio may print notes before the JSON
    job = j["jobs"][0]                          # group_reporting=1: one aggregate
    r, w = job["read"], job["write"]
    rio, wio = r["total_ios"], w["total_ios"]
    lat = (r["lat_ns"]["mean"] * rio + w["lat_ns"]["mean"] * wio) / max(1, rio + wio) / 1000
    storage = int(open(f"{work}/{p}.{i}.storage").read())
    amp = storage / w["io_bytes"] if storage >= 0 and w["io_bytes"] else None
    return {"total": r["iops"] + w["iops"], "read": r["iops"], "write": w["iops"], "lat": lat,
            "amp": amp, "err": job["error"]}

res = {}
for p in peers:
    runs = [load(p, i) for i in range(rounds)]
    if any(x["err"] for x in runs):
        sys.exit(f"fio reported an error against {p}")
    res[p] = {k: statistics.median(x[k] for x in runs) for k in ("total", "read", "write", "lat")}
    amps = [x["amp"] for x in runs if x["amp"] is not None]
    res[p]["amp"] = statistics.median(amps) if amps else None
    res[p]["runs"] = [round(x["total"]) for x in runs]

def ratio(p, ref):
    return f"{res[p]['total'] / res[ref]['total']:.2f}" if ref in res else "n/a"

def amp(p):
    if p in ("raw-disk", "raw-disk-inproc"):
        return "1 (direct)"
    if p == "raw-disk-buf":
        return "n/a (page cache)"
    a = res[p]["amp"]
    return "n/a" if a is None else f"{a:.2f}"

label = "median of %d rounds" % rounds if rounds > 1 else "1 round"
print("| peer | total IOPS | read IOPS | write IOPS | mean latency (µs) | storage writes / guest write | vs raw-disk | vs device-disk |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for p in peers:
    x = res[p]
    print(f"| {p} | {x['total']:.0f} | {x['read']:.0f} | {x['write']:.0f} | {x['lat']:.0f} "
          f"| {amp(p)} | {ratio(p, 'raw-disk')} | {ratio(p, 'device-disk')} |")
print()
print(f"({label}; total IOPS per round: " +
      "; ".join(f"{p} {x['runs']}" for p, x in res.items()) + ")")
ram = next((p for p in ("device-ram-2g", "ram-overflow-2g") if p in res), None)
if ram and "raw-disk" in res and "device-disk" in res:
    # Client and server share the CPUs: if a request's costs add up, one O_DIRECT write per
    # guest write (raw-disk's cost) plus the trip through NBD and a RAM cache (ram's cost)
    # allows this many IOPS. An estimate from two measured peers, not a measurement.
    bound = 1 / (1 / res["raw-disk"]["total"] + 1 / res[ram]["total"])
    print()
    print(f"If the costs of one request add up (raw-disk's O_DIRECT write plus {ram}'s trip through NBD): "
          f"{bound:.0f} IOPS, {bound / res['raw-disk']['total']:.2f}x raw-disk; device-disk reaches "
          f"{res['device-disk']['total'] / bound:.2f}x that.")
inproc = [p for p in ("device-disk-inproc", "device-disk-inproc-base-direct") if p in res]
if inproc and "raw-disk" in res:
    print()
    print("In process, without NBD (the cache layer alone): " + "; ".join(
        f"{p} / raw-disk = {ratio(p, 'raw-disk')}"
        + (f", / raw-disk-inproc = {ratio(p, 'raw-disk-inproc')}" if "raw-disk-inproc" in res else "")
        for p in inproc) + ".")
if "device-disk-buf" in res and "raw-disk-buf" in res:
    print()
    print(f"Same flags through the page cache: device-disk-buf / raw-disk-buf = {ratio('device-disk-buf', 'raw-disk-buf')}.")
traced = [p for p in peers if p.endswith("-trace") and p[:-len("-trace")] in res]
if traced:
    print()
    print("Recording a trace (--record-trace), total IOPS against the same peer without: " +
          "; ".join(f"{p} {ratio(p, p[:-len('-trace')])}" for p in traced) + ".")
PYEOF
)

header="### Write caches under the VDI profile (NBD over a unix socket)

\`bench/cache-vdi.sh ${args_given}\` — $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, $(fio --version),
$(nbdkit --version 2>/dev/null | head -n1), $(qemu-nbd --version 2>/dev/null | head -n1), file system $(stat -f -c %T "$work");
job file \`shared/bench/vdi.fio\` with --size=$size --runtime=$runtime, base = raw file of $size of random data.
Peers: ${available[*]} (see the script's header for each command line); fio and server on the same machine.
"
printf '%s\n%s\n' "$header" "$table"
if [[ -n $out ]]; then
    printf '%s\n%s\n' "$header" "$table" >"$out"
    echo "wrote $out" >&2
fi
