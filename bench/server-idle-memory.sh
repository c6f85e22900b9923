#!/usr/bin/env bash
# bench/server-idle-memory.sh — what an idle target costs a server: --targets NBD
# connections from one load process (/usr/bin/python3 with one libnbd handle per
# connection, each through the handshake, then idle) to one server over a unix socket.
# For each peer the script reads the server's VmRSS, RssAnon and Threads from
# /proc/PID/status before the first connection, with all of them open (after --settle
# seconds) and again after they closed; it prints the figures and the growth per idle
# target. Peers, all serving the same raw file (the base of a vDisk in a fresh store):
#   vdstream     vdstream server --store STORE              (export vdisk/golden; defaults:
#                --threads 16 workers per connection, --read-cache 256M, filled lazily)
#   vdstream-t1  the same with --threads 1
#   qemu-nbd     qemu-nbd -r -f raw -e TARGETS -t FILE
#   nbdkit       nbdkit -r file FILE                      (default --threads 16)
# When a server refuses or drops connections, the load process stops at the first failure
# and the figures are for the connections that did open (the "connected" column).
# Rounds alternate the order of the peers.
#
# Usage: bench/server-idle-memory.sh [--targets 500] [--rounds 2] [--settle 3]
#                                    [--peers vdstream,vdstream-t1,qemu-nbd,nbdkit]
# Environment: VDSTREAM_BIN, TMPDIR.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"

targets=500 rounds=2 settle=3 peers_arg=vdstream,vdstream-t1,qemu-nbd,nbdkit
args_given="$*"
while (($#)); do
    case $1 in
    --targets) targets=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --settle) settle=$2; shift ;;
    --peers) peers_arg=$2; shift ;;
    -h | --help) bench_help ;;
    *) bench_bad_arg "$1" ;;
    esac
    shift
done
need_vdstream
((targets >= 1 && targets <= 5000)) || { echo "server-idle-memory.sh: --targets must be 1..5000" >&2; exit 2; }
IFS=, read -r -a peers <<<"$peers_arg"
for p in "${peers[@]}"; do
    case $p in
    vdstream | vdstream-t1) ;;
    qemu-nbd | nbdkit) command -v "$p" >/dev/null || { echo "server-idle-memory.sh: $p not found" >&2; exit 2; } ;;
    *) echo "server-idle-memory.sh: unknown peer $p (see --help)" >&2; exit 2 ;;
    esac
done
"$PY" -c 'import nbd' 2>/dev/null || { echo "server-idle-memory.sh: $PY lacks the libnbd module (apt-get install python3-libnbd)" >&2; exit 2; }

# Every connection holds a few descriptors in the server and one in the load process.
want=$((targets * 8 + 256))
if (($(ulimit -n) < want)); then
    ulimit -n "$(($(ulimit -Hn) < want ? $(ulimit -Hn) : want))"
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/vdstream-idle-memory.XXXXXX")
server_pid='' load_pid=''
BENCH_PID_VARS="load_pid server_pid"
bench_cleanup_on_exit
export VDSTREAM_STORE=$work/store

head -c 64M /dev/urandom >"$work/golden.img"
"$VDSTREAM_BIN" vdisk import golden "$work/golden.img" >/dev/null
rm -f "$work/golden.img"
base=$(find "$work/store" -name 'golden.base.*' -print -quit)
[[ -f $base ]] || { echo "server-idle-memory.sh: cannot find the vDisk's base in $work/store" >&2; exit 1; }

# mem PID — "RSS_KiB ANON_KiB THREADS" of a live process.
mem() {
    awk '/^VmRSS:/ {r = $2} /^RssAnon:/ {a = $2} /^Threads:/ {t = $2} END {print r, a, t}' "/proc/$1/status"
}

# The load process: opens connections one by one, writes "K" (how many are open) to
# STATUS after each, and "K done" or "K failed: WHY" at the end; then holds them until
# the file STOP exists (at most 600 s), and closes them.
load_script=$work/idle-load.py
cat >"$load_script" <<'PYEOF'
import os, sys, time
import nbd
uri, n, status, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
def say(text):
    with open(status + ".tmp", "w") as f:
        f.write(text)
    os.replace(status + ".tmp", status)
handles, why = [], None
for i in range(n):
    h = nbd.NBD()
    try:
        h.connect_uri(uri)
        h.get_size()
    except nbd.Error as e:
        why = f"connection {i + 1}: {e}".replace("\n", " ")
        break
    handles.append(h)
    if i % 50 == 49:
        say(str(len(handles)))
say(f"{len(handles)} failed: {why}" if why else f"{len(handles)} done")
deadline = time.monotonic() + 600
while not os.path.exists(stop) and time.monotonic() < deadline:
    time.sleep(0.1)
for h in handles:
    try:
        h.shutdown()
    except nbd.Error:
        pass
handles.clear()  # a libnbd handle closes its socket when it is freed
PYEOF

# run_peer NAME ROUND — appends one line to $work/results: NAME ROUND connected
# before(rss anon threads) open(...) closed(...) secs-to-connect [why].
run_peer() {
    local name=$1 r=$2 sock=$work/$1.sock log=$work/$1.$2.log uri export=''
    case $name in
    vdstream | vdstream-t1)
        local threads=16
        [[ $name == vdstream-t1 ]] && threads=1
        "$VDSTREAM_BIN" server --socket "$sock" --threads "$threads" >"$log" 2>&1 </dev/null &
        server_pid=$!
        export=vdisk/golden ;;
    qemu-nbd)
        qemu-nbd -r -f raw -t -e "$targets" -k "$sock" "$base" >"$log" 2>&1 </dev/null &
        server_pid=$! ;;
    nbdkit)
        nbdkit -f -r -U "$sock" file "$base" >"$log" 2>&1 </dev/null &
        server_pid=$! ;;
    esac
    uri="nbd+unix:///$export?socket=$sock"
    local deadline=$((SECONDS + 60))
    until [[ -S $sock ]] && timeout 5 nbdinfo --size "$uri" >/dev/null 2>&1; do
        if ! kill -0 "$server_pid" 2>/dev/null || ((SECONDS >= deadline)); then
            cat "$log" >&2; echo "$name did not start" >&2; exit 1
        fi
        sleep 0.1
    done
    sleep 1
    local before opened closed status t0 t1
    before=$(mem "$server_pid")
    rm -f "$work/stop" "$work/status"
    t0=$(date +%s.%N)
    "$PY" "$load_script" "$uri" "$targets" "$work/status" "$work/stop" 2>"$work/$name.$r.load.log" &
    load_pid=$!
    deadline=$((SECONDS + 600))
    until grep -qE 'done|failed' "$work/status" 2>/dev/null; do
        kill -0 "$load_pid" 2>/dev/null || { cat "$work/$name.$r.load.log" >&2; echo "the load process died" >&2; exit 1; }
        ((SECONDS < deadline)) || { echo "$name: connections not open after 600 s" >&2; exit 1; }
        sleep 0.2
    done
    t1=$(date +%s.%N)
    sleep "$settle"
    kill -0 "$server_pid" 2>/dev/null || { cat "$log" >&2; echo "$name died with the connections open" >&2; exit 1; }
    opened=$(mem "$server_pid")
    status=$(cat "$work/status")
    touch "$work/stop"
    wait "$load_pid" || true
    load_pid=
    sleep "$settle"
    closed=$(mem "$server_pid")
    echo "$name $r ${status%% *} $before $opened $closed $(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.2f", b - a}') ${status#* }" >>"$work/results"
    stop_pid "$server_pid"; server_pid=
    rm -f "$sock"
    sleep 1
}

loads=()
for ((r = 0; r < rounds; r++)); do
    order=("${peers[@]:r % ${#peers[@]}}" "${peers[@]:0:r % ${#peers[@]}}")
    for p in "${order[@]}"; do
        loads+=("$(cut -d' ' -f1-3 /proc/loadavg)")
        echo "round $((r + 1))/$rounds: $p" >&2
        run_peer "$p" "$r"
    done
done

table=$("$PY" - "$work/results" "$targets" "${peers[@]}" <<'PYEOF'
import statistics, sys
path, targets, peers = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rows = {}
for line in open(path):
    f = line.split()
    name, r, k = f[0], int(f[1]), int(f[2])
    b, o, c = [int(x) for x in f[3:6]], [int(x) for x in f[6:9]], [int(x) for x in f[9:12]]
    rows.setdefault(name, []).append(dict(r=r, k=k, b=b, o=o, c=c, secs=float(f[12]), why=" ".join(f[13:])))
print("| server | round | connected | RSS before (MiB) | RSS open (MiB) | RSS after close (MiB) | RSS per idle target (KiB) | anon per idle target (KiB) | threads before → open | threads per target | seconds to connect all |")
print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |")
per = {}
for name in peers:
    for x in rows[name]:
        k = max(1, x["k"])
        rss = (x["o"][0] - x["b"][0]) / k
        anon = (x["o"][1] - x["b"][1]) / k
        per.setdefault(name, []).append(rss)
        print(f"| {name} | {x['r'] + 1} | {x['k']}{'' if x['k'] == targets else ' (' + x['why'] + ')'} | {x['b'][0] / 1024:.1f} | {x['o'][0] / 1024:.1f} | "
              f"{x['c'][0] / 1024:.1f} | {rss:.0f} | {anon:.0f} | {x['b'][2]} → {x['o'][2]} | {(x['o'][2] - x['b'][2]) / k:.1f} | {x['secs']:.1f} |")
print()
med = {n: statistics.median(v) for n, v in per.items()}
ref = [n for n in ("qemu-nbd", "nbdkit") if n in med]
parts = []
for n in peers:
    rel = "; ".join(f"{med[n] / med[q]:.2f}× {q}" for q in ref if q != n and med[q] > 0)
    parts.append(f"{n} {med[n]:.0f} KiB" + (f" ({rel})" if rel else ""))
print("Median RSS per idle target: " + ", ".join(parts) + ".")
PYEOF
)
echo
echo "\`bench/server-idle-memory.sh ${args_given}\` — $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, $targets targets, $(qemu-nbd --version | head -1), $(nbdkit --version)"
echo "load average (1, 5, 15 min) at the start of each run: $(printf '[%s] ' "${loads[@]}")"
echo
echo "$table"
