#!/usr/bin/env bash
# bench/hardening.sh — issue 17's hardening fixes, each measured against the binary from
# before them (--old-bin) and, where one exists, a peer server, in the same run:
#   api    the HTTP API's latency under slow-loris: `vdstream server --http 127.0.0.1:0`
#          (store with one 64 MiB vDisk); 20 sequential curl GETs (10 of /metrics, 10 of
#          /api/v1/vdisks; --max-time 15; 0.75 s apart) with no other client (quiet),
#          then, 5 s after they opened, with 200 slow-loris sockets (one header byte a
#          second each, reopened when the server closes them) and 40 idle keep-alive
#          connections open (loaded); median and max time_total and the non-200 count.
#   fds    descriptors per NBD connection: 50 libnbd connections held open to the export,
#          /proc/PID/fd counted before and with them open: vdstream server (vdisk/d), nbdkit
#          file on the vDisk's qcow2 file (raw bytes: the descriptors are what counts), and
#          qemu-nbd -t --shared=60 -f qcow2 on the same file. The vdstream servers start
#          under a soft open-files limit of 1024 (the "its own soft limit" column shows
#          what each then runs with).
#   reports  server RSS under forged agent reports: 50 targets with records; 500 reports
#          of 60 KiB to them (round robin) and 500 of 1 MB to ids with no record; VmRSS
#          before, right after, and 70 s after (reports expire after 60 s; a GET /metrics
#          just before the last reading). Old and new servers run at the same time, so
#          the 70 s are waited once; this part runs once, not per round.
#   vdi    the data path: bench/nbd-vdi.sh --peers vdstream,vdstream-old,nbdkit-memory
#          --size 1g --runtime 10 --rounds ROUNDS (serve-image --memory 1G, order rotating).
# Rounds (api, fds, vdi) alternate which binary goes first. Everything listens on unix
# sockets or 127.0.0.1. The whole run takes about 7 minutes with --rounds 3.
#
# Usage: bench/hardening.sh [--old-bin PATH] [--new-bin PATH] [--rounds 3]
#                           [--parts api,fds,reports,vdi] [--out FILE]
#   --old-bin     the build before the fixes (default: $VDSTREAM_OLD_BIN), e.g.
#                 git worktree add /tmp/old add59d4 && (cd /tmp/old && cargo build --release)
#                 then --old-bin /tmp/old/target/release/vdstream
#   --new-bin     default: target/release/vdstream ($VDSTREAM_BIN)
#   --out FILE    also write the tables to FILE
# Environment: SHARED (for the VDI job file), TMPDIR.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"

old_bin=${VDSTREAM_OLD_BIN:-}
new_bin=$VDSTREAM_BIN rounds=3 parts=api,fds,reports,vdi out=''
args_given="$*"
while (($#)); do
    case $1 in
    --old-bin) old_bin=$2; shift ;;
    --new-bin) new_bin=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --parts) parts=$2; shift ;;
    --out) out=$2; shift ;;
    -h | --help) bench_help ;;
    *) bench_bad_arg "$1" ;;
    esac
    shift
done
[[ $rounds =~ ^[1-9][0-9]*$ ]] && ((rounds <= 10)) || { echo "hardening.sh: --rounds must be 1..10" >&2; exit 2; }
[[ -n $old_bin ]] || { echo "hardening.sh: give the build before the fixes with --old-bin PATH (see --help)" >&2; exit 2; }
for b in "$old_bin" "$new_bin"; do
    [[ -x $b ]] || { echo "hardening.sh: $b is not an executable (see --old-bin, --new-bin)" >&2; exit 2; }
done
old_bin=$(realpath "$old_bin") new_bin=$(realpath "$new_bin")
need_cmds curl nbdkit qemu-nbd nbdinfo fio
"$PY" -c 'import nbd' 2>/dev/null || { echo "hardening.sh: $PY lacks the libnbd module (apt-get install python3-libnbd)" >&2; exit 2; }
LOAD=$ROOT/bench/hardening-load.py

work=$(mktemp -d "${TMPDIR:-/tmp}/vdstream-hardening.XXXXXX")
server_pid='' server2_pid='' load_pid=''
BENCH_PID_VARS="load_pid server_pid server2_pid"
bench_cleanup_on_exit

# bin_of old|new — the binary.
bin_of() { if [[ $1 == old ]]; then echo "$old_bin"; else echo "$new_bin"; fi; }

# make_store BIN DIR TARGETS — a store in DIR, made by BIN, with vDisk d (64 MiB) and
# TARGETS target records.
make_store() {
    local bin=$1 dir=$2 n=$3 i
    VDSTREAM_STORE=$dir "$bin" vdisk create d --size 64M >/dev/null
    for ((i = 1; i <= n; i++)); do
        VDSTREAM_STORE=$dir "$bin" target add "t$i" --vdisk d --cache ram-overflow >/dev/null
    done
}

# start_server BIN STORE SOCK LOG — `server --http 127.0.0.1:0`; sets server_pid and port.
start_server() {
    local bin=$1 store=$2 sock=$3 log=$4 url='' i
    "$bin" server --store "$store" --socket "$sock" --http 127.0.0.1:0 >"$log" 2>&1 </dev/null &
    server_pid=$!
    for ((i = 0; i < 200; i++)); do
        url=$(grep -Eo 'http://127\.0\.0\.1:[0-9]+' "$log" 2>/dev/null | head -n1 || true)
        [[ -n $url ]] && break
        kill -0 "$server_pid" 2>/dev/null || { cat "$log" >&2; echo "server $bin exited at start" >&2; exit 1; }
        sleep 0.1
    done
    [[ -n $url ]] || { cat "$log" >&2; echo "server $bin did not print its API address in 20 s" >&2; exit 1; }
    port=${url##*:}
}

rss() { awk '/^VmRSS:/ {print $2}' "/proc/$1/status"; }

# get_times PORT FILE — 20 sequential GETs 0.75 s apart (15 s in all: past the new API's
# 10 s header deadline, so slow sockets are closed and reopened meanwhile), one
# "PATH CODE SECONDS" line each to FILE.
get_times() {
    local port=$1 file=$2 i path line
    : >"$file"
    for ((i = 0; i < 20; i++)); do
        if ((i % 2)); then path=/api/v1/vdisks; else path=/metrics; fi
        line=$(curl -s -o /dev/null --max-time 15 -w '%{http_code} %{time_total}' "http://127.0.0.1:$port$path" || true)
        echo "$path $line" >>"$file"
        sleep 0.75
    done
}

# ---- api: latency under slow-loris ------------------------------------------------------
part_api() {
    local r b
    make_store "$old_bin" "$work/api-old" 0
    make_store "$new_bin" "$work/api-new" 0
    for ((r = 0; r < rounds; r++)); do
        local order=(new old)
        ((r % 2)) && order=(old new)
        for b in "${order[@]}"; do
            echo "api round $((r + 1))/$rounds: $b" >&2
            start_server "$(bin_of "$b")" "$work/api-$b" "$work/api.sock" "$work/api.$b.$r.log"
            sleep 0.5
            get_times "$port" "$work/api.$b.quiet.$r"
            rm -f "$work/stop"
            "$PY" "$LOAD" loris 127.0.0.1 "$port" 200 40 "$work/stop" >"$work/api.$b.loris.$r" 2>&1 &
            load_pid=$!
            sleep 5 # the slow sockets are open and dripping
            get_times "$port" "$work/api.$b.loaded.$r"
            touch "$work/stop"
            wait "$load_pid" || true
            load_pid=
            stop_pid "$server_pid"; server_pid=
            rm -f "$work/api.sock"
        done
    done
    "$PY" - "$work" "$rounds" >"$work/table.api" <<'PYEOF'
import statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
print("| binary | clients | round | median (ms) | max (ms) | non-200 of 20 | answers | median loaded / quiet |")
print("| --- | --- | ---: | ---: | ---: | ---: | --- | ---: |")
summary = {}
for b in ("old", "new"):
    for r in range(rounds):
        med = {}
        for mode in ("quiet", "loaded"):
            rows = [l.split() for l in open(f"{work}/api.{b}.{mode}.{r}")]
            t = [float(x[2]) * 1000 if len(x) == 3 else 15000.0 for x in rows]
            bad = sum(1 for x in rows if len(x) != 3 or x[1] != "200")
            med[mode] = statistics.median(t)
            summary.setdefault((b, mode), []).append((med[mode], max(t), bad))
            ratio = f"{med['loaded'] / med['quiet']:.1f}×" if mode == "loaded" else ""
            who = "200 slow-loris + 40 idle keep-alive" if mode == "loaded" else "none (quiet)"
            codes = {}
            for x in rows:
                c = x[1] if len(x) == 3 else "none"
                codes[c] = codes.get(c, 0) + 1
            ans = ", ".join(f"{c}×{k}" for c, k in sorted(codes.items()))
            print(f"| {b} | {who} | {r + 1} | {med[mode]:.1f} | {max(t):.1f} | {bad} | {ans} | {ratio} |")
print()
for b in ("old", "new"):
    q = statistics.median(x[0] for x in summary[(b, "quiet")])
    l = statistics.median(x[0] for x in summary[(b, "loaded")])
    mx = max(x[1] for x in summary[(b, "loaded")])
    bad = sum(x[2] for x in summary[(b, "loaded")])
    print(f"- {b}: median {q:.1f} ms quiet, {l:.1f} ms loaded ({l / q:.1f}×), loaded max {mx:.0f} ms, "
          f"{bad} of {20 * rounds} loaded answers not 200")
PYEOF
    for f in "$work"/api.*.loris.*; do echo "$(basename "$f"): $(cat "$f")"; done >>"$work/table.api"
}

# ---- fds: descriptors per NBD connection ------------------------------------------------
part_fds() {
    local r p n=50 qcow
    make_store "$old_bin" "$work/fds-old" 0
    make_store "$new_bin" "$work/fds-new" 0
    qcow=$(find "$work/fds-new" -name 'd.base.qcow2' -print -quit)
    : >"$work/fds.results"
    for ((r = 0; r < rounds; r++)); do
        local order=(new old nbdkit qemu-nbd)
        order=("${order[@]:r % 4}" "${order[@]:0:r % 4}")
        for p in "${order[@]}"; do
            echo "fds round $((r + 1))/$rounds: $p" >&2
            local sock=$work/fds.sock log=$work/fds.$p.$r.log uri
            case $p in
            old | new)
                # under the usual default soft limit: the new server raises it at start
                (ulimit -Sn 1024 && exec "$(bin_of "$p")" server --store "$work/fds-$p" --socket "$sock") >"$log" 2>&1 </dev/null &
                uri="nbd+unix:///vdisk/d?socket=$sock" ;;
            nbdkit)
                nbdkit -f -U "$sock" file "$qcow" >"$log" 2>&1 </dev/null &
                uri="nbd+unix:///?socket=$sock" ;;
            qemu-nbd)
                qemu-nbd -t --shared=60 -f qcow2 -k "$sock" "$qcow" >"$log" 2>&1 </dev/null &
                uri="nbd+unix:///?socket=$sock" ;;
            esac
            server_pid=$!
            local deadline=$((SECONDS + 30))
            until [[ -S $sock ]] && timeout 5 nbdinfo --size "$uri" >/dev/null 2>&1; do
                if ! kill -0 "$server_pid" 2>/dev/null || ((SECONDS >= deadline)); then
                    cat "$log" >&2; echo "$p did not start serving $uri in 30 s" >&2; exit 1
                fi
                sleep 0.1
            done
            sleep 1
            local before opened status soft
            before=$(find "/proc/$server_pid/fd" -mindepth 1 | wc -l)
            soft=$(awk '/^Max open files/ {print $4}' "/proc/$server_pid/limits")
            rm -f "$work/stop" "$work/status"
            "$PY" "$LOAD" nbdhold "$uri" "$n" "$work/status" "$work/stop" 2>"$work/fds.$p.$r.load" &
            load_pid=$!
            deadline=$((SECONDS + 60))
            until grep -qE 'done|failed' "$work/status" 2>/dev/null; do
                kill -0 "$load_pid" 2>/dev/null || { cat "$work/fds.$p.$r.load" >&2; exit 1; }
                ((SECONDS < deadline)) || { echo "$p: $n connections not open in 60 s" >&2; exit 1; }
                sleep 0.1
            done
            sleep 1
            opened=$(find "/proc/$server_pid/fd" -mindepth 1 | wc -l)
            status=$(cat "$work/status")
            touch "$work/stop"; wait "$load_pid" || true; load_pid=
            echo "$p $r ${status%% *} $before $opened $soft" >>"$work/fds.results"
            stop_pid "$server_pid"; server_pid=
            rm -f "$sock"
        done
    done
    "$PY" - "$work/fds.results" <<'PYEOF' >"$work/table.fds"
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    p, r, k, b, o, soft = line.split()
    rows.setdefault(p, []).append((int(r), int(k), int(b), int(o), soft))
names = {"old": "vdstream server, old", "new": "vdstream server, new", "nbdkit": "nbdkit file",
         "qemu-nbd": "qemu-nbd -t --shared=60"}
print("| server | connections | fds before | fds with them open (per round) | fds per connection | connections under a soft limit of 1024 | its own soft limit |")
print("| --- | ---: | ---: | --- | ---: | ---: | ---: |")
per = {}
for p in ("old", "new", "nbdkit", "qemu-nbd"):
    x = rows[p]
    k = x[0][1]
    f = statistics.median((o - b) / max(1, kk) for _, kk, b, o, _ in x)
    per[p] = f
    print(f"| {names[p]} | {k} | {x[0][2]} | {', '.join(str(o) for _, _, _, o, _ in x)} | {f:.2f} | "
          f"{int((1024 - x[0][2]) // f) if f else 'n/a'} | {x[0][4]} |")
print()
print(f"- fds per connection, new/old: {per['new'] / per['old']:.2f}; new/nbdkit: {per['new'] / per['nbdkit']:.2f}; "
      f"new/qemu-nbd: {per['new'] / per['qemu-nbd']:.2f}")
PYEOF
}

# ---- reports: server memory under forged agent reports ----------------------------------
part_reports() {
    local b codes
    declare -A pid_of port_of
    for b in old new; do
        make_store "$(bin_of "$b")" "$work/rep-$b" 50
        start_server "$(bin_of "$b")" "$work/rep-$b" "$work/rep-$b.sock" "$work/rep-$b.log"
        pid_of[$b]=$server_pid port_of[$b]=$port
        if [[ $b == old ]]; then server2_pid=$server_pid; server_pid=; fi
    done
    sleep 1
    : >"$work/rep.results"
    for b in new old; do
        local before after t0 t1
        before=$(rss "${pid_of[$b]}")
        echo "reports: $b (500 x 60 KiB to 50 targets, 500 x 1 MB to unknown ids)" >&2
        t0=$SECONDS
        codes=$("$PY" "$LOAD" reports 127.0.0.1 "${port_of[$b]}" t 50 500 61440 500 1000000)
        t1=$SECONDS
        after=$(rss "${pid_of[$b]}")
        echo "$b $before $after $((t1 - t0)) $codes" >>"$work/rep.results"
    done
    echo "reports: waiting 70 s for the reports to expire" >&2
    sleep 70
    for b in old new; do
        curl -s -o /dev/null --max-time 15 "http://127.0.0.1:${port_of[$b]}/metrics" || true
    done
    sleep 1
    for b in old new; do
        echo "$b $(rss "${pid_of[$b]}")" >>"$work/rep.late"
    done
    stop_pid "$server_pid"; server_pid=
    stop_pid "$server2_pid"; server2_pid=
    "$PY" - "$work/rep.results" "$work/rep.late" <<'PYEOF' >"$work/table.reports"
import sys
res = {l.split()[0]: l.split() for l in open(sys.argv[1])}
late = {l.split()[0]: int(l.split()[1]) for l in open(sys.argv[2])}
print("| binary | answers (HTTP status:count) | seconds to send | RSS before (MiB) | RSS right after (MiB) | RSS 70 s after (MiB) | 70 s after / before |")
print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
for b in ("old", "new"):
    x = res[b]
    before, after = int(x[1]), int(x[2])
    print(f"| {b} | {' '.join(x[4:])} | {x[3]} | {before / 1024:.1f} | {after / 1024:.1f} | {late[b] / 1024:.1f} | {late[b] / before:.2f}× |")
print()
o, n = late["old"], late["new"]
print(f"- RSS 70 s after, new/old: {n / o:.3f}; right after, new/old: {int(res['new'][2]) / int(res['old'][2]):.3f}")
PYEOF
}

# ---- vdi: the data path, through bench/nbd-vdi.sh ---------------------------------------
part_vdi() {
    need_jobfile
    VDSTREAM_BIN=$new_bin VDSTREAM_OLD_BIN=$old_bin "$ROOT/bench/nbd-vdi.sh" --size 1g --runtime 10 \
        --rounds "$rounds" --peers vdstream,vdstream-old,nbdkit-memory --keep "$work/vdi" >"$work/vdi.table"
    "$PY" - "$work/vdi" "$rounds" <<'PYEOF' >"$work/table.vdi"
import json, statistics, sys
d, rounds = sys.argv[1], int(sys.argv[2])
def iops(p, r):
    t = open(f"{d}/{p}.{r}.json").read()
    j = json.loads(t[t.index("{"):])["jobs"][0]
    return j["read"]["iops"] + j["write"]["iops"]
print("| round | new IOPS | old IOPS | nbdkit memory IOPS | new/old | new/nbdkit |")
print("| ---: | ---: | ---: | ---: | ---: | ---: |")
a, b = [], []
for r in range(rounds):
    n, o, k = iops("vdstream", r), iops("vdstream-old", r), iops("nbdkit-memory", r)
    a.append(n / o); b.append(n / k)
    print(f"| {r + 1} | {n:.0f} | {o:.0f} | {k:.0f} | {n / o:.2f} | {n / k:.2f} |")
print(f"| median | | | | **{statistics.median(a):.2f}** | **{statistics.median(b):.2f}** |")
PYEOF
}

IFS=, read -r -a part_list <<<"$parts"
for p in "${part_list[@]}"; do
    case $p in
    api | fds | reports | vdi) ;;
    *) echo "hardening.sh: unknown part $p (api, fds, reports, vdi)" >&2; exit 2 ;;
    esac
done
loads=$(cut -d' ' -f1-3 /proc/loadavg)
t_start=$SECONDS
for p in "${part_list[@]}"; do "part_$p"; done

{
    echo "\`bench/hardening.sh ${args_given}\` — $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, load average at start $loads,"
    echo "$((SECONDS - t_start)) s in all; old = $old_bin, new = $new_bin;"
    echo "$(nbdkit --version | head -n1), $(qemu-nbd --version | head -n1), $(fio --version), $(curl --version | head -n1 | cut -d' ' -f1-2)"
    for p in "${part_list[@]}"; do
        echo
        echo "#### $p"
        echo
        cat "$work/table.$p"
    done
} >"$work/report"
cat "$work/report"
if [[ -n $out ]]; then cp "$work/report" "$out"; echo "wrote $out" >&2; fi
