#!/usr/bin/env bash
# bench/nbd-flood.sh — a flood of unread READs against each NBD server, and a normal
# client's latency meanwhile (bench/nbd-flood.py): 24 connections each send 40 READs of
# 32 MiB (simple replies: every byte must be sent) and never read a reply, for --seconds;
# meanwhile libnbd (default settings) reads 4 KiB at a time, QD1, on the same export.
# Before the flood the same client runs alone for --seconds ("quiet"). Peers, each a fresh
# server with a 1 GiB export on a unix socket:
#   vdstream       vdstream serve-image --memory 1G (default --max-request-memory 128M)
#   vdstream-old   the same with --old-bin (the build before the bound), when given
#   nbdkit         nbdkit memory 1G
#   qemu-nbd       qemu-nbd -f raw --persistent --shared=32 on a 1 GiB sparse file
# A server's flood is closed once its RSS passes --rss-cap (default 4G): the growth of a
# server without a bound is then reported as "at least". A server that dies under the
# flood is reported so. Prints per round each server's
# RSS growth and the normal client's reads, errors and p50/p99/max latency (quiet and
# under the flood), then the medians and the ratios against vdstream.
#
# Usage: bench/nbd-flood.sh [--rounds 3] [--seconds 10] [--rss-cap 4G] [--old-bin PATH]
#                           [--peers vdstream,vdstream-old,nbdkit,qemu-nbd]
# Environment: VDSTREAM_BIN, TMPDIR.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"

rounds=3 seconds=10 cap=4G old_bin=${VDSTREAM_OLD_BIN:-} peers=
while (($#)); do
    case $1 in
    --rounds) rounds=$2; shift ;;
    --seconds) seconds=$2; shift ;;
    --rss-cap) cap=$2; shift ;;
    --old-bin) old_bin=$2; shift ;;
    --peers) peers=$2; shift ;;
    -h | --help) bench_help ;;
    *) bench_bad_arg "$1" ;;
    esac
    shift
done
need_vdstream
need_cmds nbdkit qemu-nbd nbdinfo
[[ -n $peers ]] || peers=vdstream${old_bin:+,vdstream-old},nbdkit,qemu-nbd
IFS=, read -ra names <<<"$peers"

work=$(mktemp -d "${TMPDIR:-/tmp}/vdstream-flood.XXXXXX")
server_pid=
bench_cleanup_on_exit
truncate -s 1G "$work/disk.raw"

start() { # NAME SOCK LOG — starts NAME's server, sets server_pid
    local name=$1 sock=$2 log=$3
    case $name in
    vdstream) "$VDSTREAM_BIN" serve-image --memory 1G --socket "$sock" >"$log" 2>&1 & ;;
    vdstream-old) "$old_bin" serve-image --memory 1G --socket "$sock" >"$log" 2>&1 & ;;
    nbdkit) nbdkit --foreground --unix "$sock" memory 1G >"$log" 2>&1 & ;;
    qemu-nbd) qemu-nbd -f raw --persistent --shared=32 --socket "$sock" "$work/disk.raw" >"$log" 2>&1 & ;;
    *) echo "unknown peer $name (vdstream, vdstream-old, nbdkit, qemu-nbd)" >&2; exit 2 ;;
    esac
    server_pid=$!
    wait_nbd_ready "$server_pid" "$sock" "$log" "$name" 20
}

results=$work/results.jsonl
for ((r = 1; r <= rounds; r++)); do
    # Rotate the order each round.
    order=("${names[@]:$(((r - 1) % ${#names[@]}))}" "${names[@]:0:$(((r - 1) % ${#names[@]}))}")
    for name in "${order[@]}"; do
        sock=$work/$name.sock
        rm -f "$sock"
        start "$name" "$sock" "$work/$name.$r.log"
        out=$("$PY" "$ROOT/bench/nbd-flood.py" "$sock" "" "$server_pid" --conns 24 --reads 40 --size 32M \
            --seconds "$seconds" --quiet-first "$seconds" --rss-cap "$cap")
        echo "{\"round\": $r, \"server\": \"$name\", \"flood\": $out}" >>"$results"
        stop_pid "$server_pid"
        server_pid=
        echo "round $r $name: $out"
    done
done

"$PY" - "$results" "$cap" <<'EOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
names = list(dict.fromkeys(r["server"] for r in rows))
med = lambda xs: statistics.median(xs) if xs else None
mib = lambda b: b / (1 << 20)
print()
print("| server | RSS growth under the flood (MiB) | server | normal client: reads in the flood window | errors | p50 / p99 / max latency quiet (ms) | p50 / p99 / max latency under the flood (ms) |")
print("| --- | ---: | --- | ---: | ---: | --- | --- |")
summary = {}
for n in names:
    rs = [r["flood"] for r in rows if r["server"] == n]
    g = med([f["growth"] for f in rs])
    capped = any(f["capped"] for f in rs)
    lat = lambda key: med([f["latency_ms"][key] for f in rs if f["latency_ms"][key] is not None])
    qlat = lambda key: med([f["quiet"]["latency_ms"][key] for f in rs])
    summary[n] = (g, capped, lat("p99"))
    died = sum(f["server_died"] for f in rs)
    print(f"| {n} | {'at least ' if capped else ''}{mib(g):.0f} | {f'died in {died} of {len(rs)} rounds' if died else 'alive'} | {med([f['normal_reads'] for f in rs]):.0f} | {sum(f['normal_errors'] for f in rs)} | "
          f"{qlat('p50'):.3f} / {qlat('p99'):.3f} / {qlat('max'):.3f} | "
          + (f"{lat('p50'):.3f} / {lat('p99'):.3f} / {lat('max'):.3f} |" if lat('p50') is not None else "none completed |"))
if "vdstream" in summary:
    g0 = summary["vdstream"][0]
    print()
    for n, (g, capped, _) in summary.items():
        if n != "vdstream":
            print(f"vdstream's growth / {n}'s: {'at most ' if capped else ''}{g0 / g:.3f}x")
EOF
