#!/usr/bin/env bash
# bench/disk-cache-ab.sh — A/B of device-disk cache settings under the VDI profile
# (shared/bench/vdi.fio, fio's nbd engine over a unix socket), each setting beside the raw
# disk in the same run. Every round runs every setting once, in the order given, and the
# table shows each setting's total IOPS per round, the median, and the median relative to
# the raw disk (fio --ioengine=io_uring --direct=1 on a copy of the base).
#
# Usage: bench/disk-cache-ab.sh [--size 1g] [--runtime 8] [--rounds 2] NAME=ARGS...
#   NAME=ARGS   a setting: extra arguments to `vdstream serve-image BASE --cache device-disk`,
#               e.g. sync='--io-engine sync' uring='--io-engine io_uring' t4='--threads 4'
#   An ARGS may start with ENV=VALUE words, passed to the server's environment.
# Environment: SHARED (default: the `shared` folder beside the repo), VDSTREAM_BIN, TMPDIR.

set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"

size=1g runtime=8 rounds=2 settings=()
while (($#)); do
    case $1 in
    --size) size=$2; shift ;;
    --runtime) runtime=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    -h | --help) bench_help ;;
    *=*) settings+=("$1") ;;
    *) bench_bad_arg "$1" ;;
    esac
    shift
done
((${#settings[@]})) || { echo "give at least one NAME=ARGS setting (see --help)" >&2; exit 2; }
need_vdstream
need_jobfile

work=$(mktemp -d "${TMPDIR:-/tmp}/vdstream-disk-ab.XXXXXX")
server_pid=
bench_cleanup_on_exit
head -c "$(numfmt --from=iec "${size^^}")" /dev/urandom >"$work/base.img"

iops() {
    /usr/bin/python3 -c 'import json,sys; t=open(sys.argv[1]).read(); j=json.loads(t[t.index("{"):])["jobs"][0]; print(round(j["read"]["iops"]+j["write"]["iops"]))' "$1"
}

results=$work/results
for ((r = 1; r <= rounds; r++)); do
    for s in raw "${settings[@]}"; do
        name=${s%%=*} args=${s#*=} cdir=$work/cache
        rm -rf "$cdir" && mkdir -p "$cdir"
        if [[ $s == raw ]]; then
            cp "$work/base.img" "$cdir/copy.img" && sync
            fio "$JOBFILE" --ioengine=io_uring --direct=1 --filename="$cdir/copy.img" --size="$size" \
                --runtime="$runtime" --output-format=json --output="$work/out.json" >/dev/null
        else
            env_words=() arg_words=()
            read -r -a words <<<"$args"
            for w in "${words[@]}"; do
                if [[ $w =~ ^[A-Z_][A-Z0-9_]*= && ${#arg_words[@]} -eq 0 ]]; then env_words+=("$w"); else arg_words+=("$w"); fi
            done
            sock=$work/s.sock
            env "${env_words[@]}" "$VDSTREAM_BIN" serve-image "$work/base.img" --socket "$sock" --overflow-dir "$cdir" \
                --cache device-disk "${arg_words[@]}" >"$work/server.log" 2>&1 </dev/null &
            server_pid=$!
            wait_nbd_ready "$server_pid" "$sock" "$work/server.log" "$name" 60
            fio "$JOBFILE" --ioengine=nbd --uri="nbd+unix:///?socket=$sock" --size="$size" \
                --runtime="$runtime" --output-format=json --output="$work/out.json" >/dev/null
            stop_pid "$server_pid" 600
            server_pid=
        fi
        v=$(iops "$work/out.json")
        echo "round $r: $name $v" >&2
        echo "$name $v" >>"$results"
        rm -rf "$cdir"
    done
done

/usr/bin/python3 - "$results" <<'PYEOF'
import statistics, sys
runs = {}
for line in open(sys.argv[1]):
    name, v = line.split()
    runs.setdefault(name, []).append(int(v))
raw = statistics.median(runs["raw"])
print("| setting | total IOPS per round | median | vs raw-disk |")
print("| --- | --- | ---: | ---: |")
for name, vs in runs.items():
    m = statistics.median(vs)
    print(f"| {name} | {vs} | {m:.0f} | {m / raw:.2f} |")
PYEOF
