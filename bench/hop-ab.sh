#!/usr/bin/env bash
# bench/hop-ab.sh — issue 18's before/after set in one run: every peer below under the VDI
# profile (shared/bench/vdi.fio: 4 jobs x QD16, 4 KiB, 80% writes, 90% random), fio's nbd
# engine over unix sockets, once with the build before (--old-bin) and once with the build
# after (--new-bin), A B A B: each round runs every peer with both builds back to back, the
# build that goes first alternating between rounds, and the order of the peers rotating.
#   ram                 serve-image --memory 1G                   (nbdkit-memory beside it)
#   direct-device-disk  serve-image --vdisk golden --cache device-disk       (O_DIRECT)
#   agent-device-disk   vdstream server + target attach --cache device-disk
#                       (the agent reads vdisk/golden from the server over NBD)
#   direct-server       serve-image --vdisk golden --cache server
#   agent-server        vdstream server (target record of type server) +
#                       target attach --server nbd+unix:///target/T --cache server
#   direct-server-persistent, agent-server-persistent   the same with server-persistent
#   nbdkit-memory       nbdkit memory 1G (once per round: the RAM disk's reference)
#   nbdkit-proxy        nbdkit's nbd plugin in front of nbdkit memory 1G: a peer's hop
#   qemu-nbd-proxy      qemu-nbd (its NBD client as the image) in front of nbdkit memory 1G
#                       The two proxies run once per round (no build of ours in them); their
#                       hop is proxy / nbdkit-memory, and the proxy's CPU is in the agent column.
# One vDisk of --size random data in a fresh store (made by the new build); caches start
# empty. Prints, per peer, the median total IOPS of each build and new/old; the hop ratios
# agent/direct (median of the per-round ratios) for each build; and the load average at
# the start of each round; and where the CPU went: CPU milliseconds per thousand guest I/Os
# of fio, the agent and the server (medians; fio's from its own report, the others' from
# /proc over the fio run). About 4 minutes a round (15 fio runs of --runtime plus starts).
#
# Usage: bench/hop-ab.sh --old-bin PATH [--new-bin PATH] [--size 1g] [--runtime 8]
#                        [--rounds 2] [--peers ram,direct-device-disk,...] [--out FILE]
#   --old-bin     the build before (default: $VDSTREAM_OLD_BIN), e.g.
#                 git worktree add /tmp/old main && (cd /tmp/old && cargo build --release)
#                 then --old-bin /tmp/old/target/release/vdstream
#   --new-bin     default: target/release/vdstream ($VDSTREAM_BIN)
#   --out FILE    also write the tables to FILE
# Environment: SHARED (for the VDI job file), TMPDIR.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"

ALL=ram,direct-device-disk,agent-device-disk,direct-server,agent-server,direct-server-persistent,agent-server-persistent
PROXIES=nbdkit-proxy,qemu-nbd-proxy
old_bin=${VDSTREAM_OLD_BIN:-} new_bin=$VDSTREAM_BIN size=1g runtime=8 rounds=2 peers_arg=$ALL out=''
args_given="$*"
while (($#)); do
    case $1 in
    --old-bin) old_bin=$2; shift ;;
    --new-bin) new_bin=$2; shift ;;
    --size) size=$2; shift ;;
    --runtime) runtime=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --peers) peers_arg=$2; shift ;;
    --out) out=$2; shift ;;
    -h | --help) bench_help ;;
    *) bench_bad_arg "$1" ;;
    esac
    shift
done
need_rounds_runtime
need_jobfile
[[ -n $old_bin ]] || { echo "hop-ab.sh: give the build before with --old-bin PATH (see --help)" >&2; exit 2; }
for b in "$old_bin" "$new_bin"; do
    [[ -x $b ]] || { echo "hop-ab.sh: $b is not an executable (see --old-bin, --new-bin)" >&2; exit 2; }
done
old_bin=$(realpath "$old_bin") new_bin=$(realpath "$new_bin")
IFS=, read -r -a peers <<<"$peers_arg"
for p in "${peers[@]}"; do
    [[ ,$ALL,$PROXIES, == *",$p,"* ]] || { echo "hop-ab.sh: --peers takes some of $ALL,$PROXIES, not $p" >&2; exit 2; }
done
ours=() proxies=()
for p in "${peers[@]}"; do
    if [[ ,$PROXIES, == *",$p,"* ]]; then proxies+=("$p"); else ours+=("$p"); fi
done
need_cmds fio nbdkit nbdinfo numfmt
((${#proxies[@]} == 0)) || need_cmds qemu-nbd
size_bytes=$(numfmt --from=iec "${size^^}")

work=$(mktemp -d "${TMPDIR:-/tmp}/vdstream-hop-ab.XXXXXX")
server_pid='' agent_pid=''
BENCH_PID_VARS="agent_pid server_pid"
bench_cleanup_on_exit
export VDSTREAM_RUN_DIR=$work/run VDSTREAM_CACHE_DIR=$work/cache VDSTREAM_STORE=$work/store

echo "making the vDisk: $size of random data in $work/store" >&2
head -c "$size_bytes" /dev/urandom >"$work/golden.img"
"$new_bin" vdisk import golden "$work/golden.img" >/dev/null
rm -f "$work/golden.img"
for c in server server-persistent; do
    "$new_bin" target add "hop-$c" --vdisk golden --cache "$c" >/dev/null
done

# cpu_secs PID — user + system CPU seconds PID has used so far (0 without a PID).
cpu_secs() {
    if [[ -n $1 && -r /proc/$1/stat ]]; then
        awk -v hz="$(getconf CLK_TCK)" '{ printf "%.2f", ($14 + $15) / hz }' "/proc/$1/stat"
    else
        echo 0
    fi
}

# run_peer PEER BUILD ROUND — start the peer with BUILD's binary (old, new, or nbdkit),
# run fio against it, stop it.
run_peer() {
    local peer=$1 build=$2 r=$3 bin=$old_bin sock=$work/server.sock uri cache id export name
    [[ $build == new ]] && bin=$new_bin
    name=$peer.$build.$r
    cache=${peer#*-}
    mkdir -p "$work/cache"
    case $peer in
    nbdkit-memory)
        nbdkit -f -U "$sock" memory "$size" >"$work/$name.server.log" 2>&1 </dev/null &
        server_pid=$!
        wait_nbd_ready "$server_pid" "$sock" "$work/$name.server.log" nbdkit 60
        uri="nbd+unix:///?socket=$sock" ;;
    nbdkit-proxy | qemu-nbd-proxy)
        # The base (nbdkit memory) is the "server", the proxy the "agent".
        nbdkit -f -U "$work/base.sock" memory "$size" >"$work/$name.server.log" 2>&1 </dev/null &
        server_pid=$!
        wait_nbd_ready "$server_pid" "$work/base.sock" "$work/$name.server.log" nbdkit 60
        if [[ $peer == nbdkit-proxy ]]; then
            nbdkit -f -U "$sock" nbd socket="$work/base.sock" >"$work/$name.agent.log" 2>&1 </dev/null &
        else
            # -t: stay after nbdinfo's probe; -e 8: fio's four jobs are four connections.
            qemu-nbd -f raw -t -e 8 -k "$sock" "nbd+unix:///?socket=$work/base.sock" \
                >"$work/$name.agent.log" 2>&1 </dev/null &
        fi
        agent_pid=$!
        wait_nbd_ready "$agent_pid" "$sock" "$work/$name.agent.log" "$peer" 60
        uri="nbd+unix:///?socket=$sock" ;;
    ram)
        "$bin" serve-image --memory "$size" --socket "$sock" >"$work/$name.server.log" 2>&1 </dev/null &
        server_pid=$!
        wait_nbd_ready "$server_pid" "$sock" "$work/$name.server.log" serve-image 60
        uri="nbd+unix:///?socket=$sock" ;;
    direct-*)
        "$bin" serve-image --vdisk golden --socket "$sock" --cache "$cache" --overflow-dir "$work/cache" \
            >"$work/$name.server.log" 2>&1 </dev/null &
        server_pid=$!
        wait_nbd_ready "$server_pid" "$sock" "$work/$name.server.log" serve-image 60
        uri="nbd+unix:///?socket=$sock" ;;
    agent-*)
        id=hop export=vdisk/golden
        case $cache in server | server-persistent) id=hop-$cache export=target/hop-$cache ;; esac
        "$bin" server --socket "$sock" >"$work/$name.server.log" 2>&1 </dev/null &
        server_pid=$!
        # The server answers only named exports: wait for its socket, then for the agent.
        for _ in $(seq 300); do [[ -S $sock ]] && break; sleep 0.1; done
        "$bin" target attach "$id" --server "nbd+unix:///$export?socket=$sock" --cache "$cache" \
            >"$work/$name.agent.log" 2>&1 </dev/null &
        agent_pid=$!
        wait_nbd_ready "$agent_pid" "$work/run/$id.sock" "$work/$name.agent.log" agent 60
        uri="nbd+unix:///?socket=$work/run/$id.sock" ;;
    esac
    local cpu0 cpu1
    cpu0="$(cpu_secs "$server_pid") $(cpu_secs "$agent_pid")"
    local TIMEFORMAT='%U %S' fio_rc=0
    { time fio "$JOBFILE" --ioengine=nbd --uri="$uri" --size="$size" --runtime="$runtime" \
        --output-format=json --output="$work/$name.json" >"$work/$name.fio.log" 2>&1 || fio_rc=$?; } 2>"$work/$name.fiocpu"
    ((fio_rc == 0)) || { cat "$work/$name.fio.log" >&2; echo "fio failed against $peer ($build)" >&2; exit 1; }
    cpu1="$(cpu_secs "$server_pid") $(cpu_secs "$agent_pid")"
    echo "$cpu0 $cpu1" >"$work/$name.cpu"
    stop_pid "$agent_pid"; agent_pid=
    stop_pid "$server_pid"; server_pid=
    rm -rf "$work/cache" "$work/run" "$work/store/cache" "$sock" "$work/base.sock"
    sleep 1
}

loads=()
for ((r = 0; r < rounds; r++)); do
    order=()
    ((${#ours[@]} == 0)) || order=("${ours[@]:r % ${#ours[@]}}" "${ours[@]:0:r % ${#ours[@]}}")
    builds=(old new)
    ((r % 2)) && builds=(new old)
    loads+=("$(cut -d' ' -f1-3 /proc/loadavg)")
    if [[ ,$peers_arg, == *,ram,* ]] || ((${#proxies[@]})); then
        echo "round $((r + 1))/$rounds: nbdkit-memory" >&2
        run_peer nbdkit-memory nbdkit "$r"
    fi
    for p in "${proxies[@]}"; do
        echo "round $((r + 1))/$rounds: $p" >&2
        run_peer "$p" peer "$r"
    done
    for p in "${order[@]}"; do
        for b in "${builds[@]}"; do
            echo "round $((r + 1))/$rounds: $p ($b)" >&2
            run_peer "$p" "$b" "$r"
        done
    done
done

table=$("$PY" - "$work" "$rounds" "${#proxies[@]}" "${proxies[@]}" "${ours[@]}" <<'PYEOF'
import json, os, statistics, sys
work, rounds, nprox = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
proxies, peers = sys.argv[4:4 + nprox], sys.argv[4 + nprox:]
def iops(p, b, i):
    text = open(f"{work}/{p}.{b}.{i}.json").read()
    job = json.loads(text[text.index("{"):])["jobs"][0]
    assert job["error"] == 0, f"fio error against {p} ({b})"
    return job["read"]["iops"] + job["write"]["iops"]
res = {}
for p in peers:
    for b in ("old", "new"):
        res[p, b] = [iops(p, b, i) for i in range(rounds)]
if "ram" in peers or proxies:
    res["nbdkit-memory", "nbdkit"] = [iops("nbdkit-memory", "nbdkit", i) for i in range(rounds)]
for p in proxies:
    res[p, "peer"] = [iops(p, "peer", i) for i in range(rounds)]
med = {k: statistics.median(v) for k, v in res.items()}
if peers:
    print("| peer | old: total IOPS (median) | new: total IOPS (median) | new / old | old per round | new per round |")
    print("| --- | ---: | ---: | ---: | --- | --- |")
for p in peers:
    o, n = med[p, "old"], med[p, "new"]
    print(f"| {p} | {o:.0f} | {n:.0f} | **{n / o:.2f}** | {', '.join(f'{x:.0f}' for x in res[p, 'old'])} | {', '.join(f'{x:.0f}' for x in res[p, 'new'])} |")
if proxies:
    print()
    m = med["nbdkit-memory", "nbdkit"]
    print("| a peer's hop | total IOPS (median) | per round | hop: proxy / nbdkit-memory, median of per-round ratios | per round |")
    print("| --- | ---: | --- | ---: | --- |")
    print(f"| nbdkit-memory | {m:.0f} | {', '.join(f'{x:.0f}' for x in res['nbdkit-memory', 'nbdkit'])} | | |")
    for p in proxies:
        per = [a / x for a, x in zip(res[p, "peer"], res["nbdkit-memory", "nbdkit"])]
        print(f"| {p} | {med[p, 'peer']:.0f} | {', '.join(f'{x:.0f}' for x in res[p, 'peer'])} | **{statistics.median(per):.2f}** | {', '.join(f'{x:.2f}' for x in per)} |")
if "ram" in peers:
    m = med["nbdkit-memory", "nbdkit"]
    if not proxies:  # (with proxies, the peers' table above has its row)
        print(f"| nbdkit-memory | {m:.0f} | | | {', '.join(f'{x:.0f}' for x in res['nbdkit-memory', 'nbdkit'])} | |")
    print()
    print(f"RAM disk / nbdkit-memory (medians): old {med['ram', 'old'] / m:.2f}, new {med['ram', 'new'] / m:.2f}.")
print()
lines = []
for p in peers:
    if not p.startswith("agent-"):
        continue
    d = "direct-" + p.removeprefix("agent-")
    if d not in peers:
        continue
    for b in ("old", "new"):
        per = [a / x for a, x in zip(res[p, b], res[d, b])]
        lines.append(f"| {p.removeprefix('agent-')} | {b} | **{statistics.median(per):.2f}** | {', '.join(f'{x:.2f}' for x in per)} |")
if lines:
    print("| hop: agent / direct | build | median of per-round ratios | per round |")
    print("| --- | --- | ---: | --- |")
    print("\n".join(lines))
def cpu_per_kio(p, b, i):
    text = open(f"{work}/{p}.{b}.{i}.json").read()
    j = json.loads(text[text.index("{"):])
    job = j["jobs"][0]
    ios = job["read"]["total_ios"] + job["write"]["total_ios"]
    fio_cpu = sum(map(float, open(f"{work}/{p}.{b}.{i}.fiocpu").read().split()))
    s0, a0, s1, a1 = map(float, open(f"{work}/{p}.{b}.{i}.cpu").read().split())
    k = max(ios, 1) / 1000
    return fio_cpu / k * 1000, (a1 - a0) / k * 1000, (s1 - s0) / k * 1000
print()
print("| peer | build | CPU ms per 1000 guest I/Os: fio | agent | server |")
print("| --- | --- | ---: | ---: | ---: |")
cpu_rows = [(p, b) for p in peers for b in ("old", "new")]
if proxies:
    cpu_rows = [("nbdkit-memory", "nbdkit")] + [(p, "peer") for p in proxies] + cpu_rows
for p, b in cpu_rows:
        rows = [cpu_per_kio(p, b, i) for i in range(rounds)]
        f, a, s = (statistics.median(r[k] for r in rows) for k in range(3))
        print(f"| {p} | {b} | {f:.1f} | {a:.1f} | {s:.1f} |")
PYEOF
)
report=$(
    echo "\`bench/hop-ab.sh ${args_given}\` — $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, $(fio --version), size=$size runtime=${runtime}s rounds=$rounds"
    echo "load average (1, 5, 15 min) at the start of each round: $(printf '[%s] ' "${loads[@]}")"
    echo
    echo "$table"
)
echo
echo "$report"
[[ -z $out ]] || echo "$report" >"$out"
