#!/usr/bin/env bash
# bench/rebalance.sh — rebalancing across a farm, beside the same farm without it
# (`vdstream server --rebalance off`) in the same run. Three store servers a, b and c on
# one store (loopback, tests/e2e/rebalance-lib.sh, --rebalance-interval --interval);
# --agents agents attach while only a runs, each listing the three API URLs; the first --fio
# of them run fio through their agent the whole time (4 KiB random reads and writes, 40%
# writes, iodepth 4, over 3/4 of the vDisk; --rate IOPS each, 0: as fast as they go), the
# rest are idle. After
# --before seconds b and c start. Per run:
#   - the time until every server holds its share ±25% of the targets (without
#     rebalancing: "never", and the farthest a server is from its share at the end);
#   - the fio agents' guest IOPS (fio's log of each second, summed over the agents) in three
#     windows: the --before seconds before b and c start; the rebalance window, from their
#     start until the farm is balanced (without rebalancing: as long as the run with it
#     took, or --wait); and the --after seconds after it; and the lowest second of the
#     rebalance window;
#   - the agents that moved (their failovers), and errors: fio jobs with an error, agents
#     that stopped, disconnected or gave up, or did not exit 0 on SIGTERM.
# Each round runs with rebalancing first, then without (over the first run's window); the
# peer is the run without, in the same invocation.
#
# Usage: bench/rebalance.sh [--agents 100] [--fio 10] [--mib 32] [--interval 3] [--wait 60]
#                           [--before 10] [--after 10] [--rate 0] [--rounds 1]
# Environment: VDSTREAM_BIN (default target/release/vdstream), VDSTREAM_E2E_KEEP=1, TMPDIR.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"
agents=100 nfio=10 mib=32 interval=3 wait=60 before=10 after=10 rate=0 rounds=1
args_given="$*"
while (($#)); do
    case $1 in
    --agents) agents=$2; shift ;;
    --fio) nfio=$2; shift ;;
    --mib) mib=$2; shift ;;
    --interval) interval=$2; shift ;;
    --wait) wait=$2; shift ;;
    --before) before=$2; shift ;;
    --after) after=$2; shift ;;
    --rate) rate=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    -h | --help) bench_help ;;
    *) bench_bad_arg "$1" ;;
    esac
    shift
done
for v in agents nfio mib interval wait before after rounds; do
    [[ ${!v} =~ ^[1-9][0-9]*$ ]] || { echo "$(basename "$0"): --${v/nfio/fio} must be a positive whole number" >&2; exit 2; }
done
((mib >= 4)) || { echo "$(basename "$0"): --mib must be at least 4" >&2; exit 2; }
[[ $rate =~ ^[0-9]+$ ]] || { echo "$(basename "$0"): --rate must be a whole number of IOPS (0: no limit)" >&2; exit 2; }
((nfio <= agents)) || { echo "$(basename "$0"): --fio $nfio is more than --agents $agents" >&2; exit 2; }
need_vdstream
need_cmds fio nbdinfo nbdsh curl

# shellcheck source=../tests/e2e/lib.sh
source "$ROOT/tests/e2e/lib.sh"
# shellcheck source=../tests/e2e/store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=../tests/e2e/server-lib.sh
source "$E2E_DIR/server-lib.sh"
# shellcheck source=../tests/e2e/agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
# shellcheck source=../tests/e2e/fio-verify.sh
source "$E2E_DIR/fio-verify.sh"
# shellcheck source=../tests/e2e/rebalance-lib.sh
source "$E2E_DIR/rebalance-lib.sh"
e2e_init
RB_INTERVAL=$interval
rate_args=() rate_said="no rate limit"
if ((rate > 0)); then
    rate_args=(--rate_iops="$rate")
    rate_said="$rate IOPS each"
fi
ids=() fio_ids=()
for ((i = 0; i < agents; i++)); do
    ids+=("t$i")
    ((i < nfio)) && fio_ids+=("t$i")
done
echo "# bench/rebalance.sh $args_given"
echo "# $(date -u +%FT%TZ), $(nproc) cores, $(fio --version); $agents agents on a $mib MiB vDisk, $nfio of them run fio" \
    "(randrw 4k, 40% writes, iodepth 4, $rate_said); --rebalance-interval $interval"
rb_setup "$agents" "$mib"
RESULTS=$E2E_TMP/results.txt
: >"$RESULTS"

# run_one MODE ROUND WINDOW — one run with `--rebalance MODE`; WINDOW: the longest wait for
# the farm to balance after b and c start. Appends a line to $RESULTS: "MODE ROUND BALANCED
# T_JOIN T_END MOVED ERRORS COUNTS..." (T_END: balanced, or the end of the wait).
run_one() {
    local mode=$1 r=$2 window=$3 tag=$1-$2 id pid i out left balanced t_join t_end moved errors fio_bad counts pids=()
    log "run $tag: --rebalance $mode"
    rb_new_run
    rm -rf "$STORE/servers" # the heartbeats of the last run's servers
    RB_SERVER_ARGS=(--rebalance "$mode")
    rb_server a
    rb_agents "${ids[@]}"
    out=$(rb_wait_spread 30 "$EPOCHREALTIME" a) || fail "run $tag: not every agent is on a: $out"
    rb_snapshot "$E2E_TMP/$tag.start"
    for id in "${fio_ids[@]}"; do
        (cd "$E2E_TMP" && exec fio --name="$id" --ioengine=nbd --uri="nbd+unix:///?socket=$VDSTREAM_RUN_DIR/$id.sock" \
            --rw=randrw --rwmixwrite=40 --bs=4k --size=$((mib * 3 / 4))m --iodepth=4 "${rate_args[@]}" \
            --time_based --runtime=3600 --write_iops_log="$tag-$id" --log_avg_msec=1000 --log_unix_epoch=1 \
            --output-format=json --output="$tag-$id.json") >"$E2E_TMP/$tag-$id.fio.log" 2>&1 &
        pids+=("$!")
        track_pid "$!"
    done
    sleep $((before + 2)) # 2 s for fio to start, then the window before
    t_join=${EPOCHREALTIME/,/.}
    rb_spawn b
    rb_spawn c
    rb_ready b
    rb_ready c
    left=$("$PY" -c 'import sys, time; print(f"{max(1.0, float(sys.argv[1]) - (time.time() - float(sys.argv[2]))):.1f}")' "$window" "$t_join")
    if out=$(rb_wait_spread "$left" "$t_join" a b c); then
        balanced=yes
        t_end=$("$PY" -c 'import sys; print(f"{float(sys.argv[1]) + float(sys.argv[2]):.3f}")' "$t_join" "${out%% *}")
    else
        balanced=no
        t_end=${EPOCHREALTIME/,/.}
    fi
    log "run $tag: $out"
    sleep $((after + 2)) # the window after, and 2 s for fio to log its last second of it
    counts=$(rb_counts)
    for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
    for pid in "${pids[@]}"; do
        for ((i = 0; i < 300; i++)); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -KILL "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
    fio_bad=$("$PY" - "$E2E_TMP" "$tag" "${fio_ids[@]}" <<'PYEOF'
import json, sys
work, tag, bad = sys.argv[1], sys.argv[2], 0
for i in sys.argv[3:]:
    try:
        text = open(f"{work}/{tag}-{i}.json").read()
        bad += any(job["error"] != 0 for job in json.loads(text[text.index("{"):])["jobs"])
    except (OSError, ValueError, KeyError):
        bad += 1
print(bad)
PYEOF
    )
    rb_snapshot "$E2E_TMP/$tag.end"
    moved=$(awk 'NR == FNR { f[$1] = $3; next } { n += $3 - f[$1] } END { print n + 0 }' "$E2E_TMP/$tag.start" "$E2E_TMP/$tag.end")
    errors=$(awk '$2 != 1 || $4 != 1 || $5 != 0 || $6 != "running"' "$E2E_TMP/$tag.end" | wc -l)
    rb_agents_stop --count
    errors=$((errors + fio_bad + RB_BAD_STOPS))
    for id in a b c; do
        rb_stop "$id" 30 || log "run $tag: server $id did not stop cleanly"
    done
    echo "$mode $r $balanced $t_join $t_end $moved $errors $counts" >>"$RESULTS"
}

for ((r = 1; r <= rounds; r++)); do
    run_one on "$r" "$wait"
    # Without rebalancing, the same window as the run with it (all of --wait if it never balanced).
    window=$(awk -v r="$r" -v w="$wait" '$1 == "on" && $2 == r { print ($3 == "yes" ? $5 - $4 : w) }' "$RESULTS")
    run_one off "$r" "$(printf '%.0f' "$window")"
done

"$PY" - "$E2E_TMP" "$RESULTS" "$before" "$after" "$RB_TOLERANCE" <<'PYEOF'
import glob, math, statistics, sys
work, results, before, after, tol = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5])

def per_second(tag):
    """Guest IOPS of every second, summed over the fio agents and both directions."""
    acc = {}
    for path in glob.glob(f"{work}/{tag}-t*_iops.*.log"):
        for line in open(path):
            f = [x.strip() for x in line.split(",")]
            if len(f) >= 2:
                s = int(f[0]) // 1000
                acc[s] = acc.get(s, 0) + int(f[1])
    return acc

def window(acc, start, end):
    """Mean and lowest of the seconds logged within [start, end) (fio stamps a second at its
    end); a window that holds no whole second takes the seconds it overlaps."""
    keys = range(math.ceil(start) + 1, math.floor(end) + 1)
    if not keys:
        keys = range(math.floor(start) + 1, math.ceil(end) + 1)
    secs = [acc.get(s, 0) for s in keys]
    return (statistics.mean(secs), min(secs)) if secs else (None, None)

def fmt(v, spec=".0f"):
    return "n/a" if v is None else format(v, spec)

rows = []
for line in open(results):
    mode, r, balanced, t_join, t_end, moved, errors, *counts = line.split()
    t_join, t_end = float(t_join), float(t_end)
    acc = per_second(f"{mode}-{r}")
    pre, _ = window(acc, t_join - before, t_join)
    during, low = window(acc, t_join, t_end)
    post, _ = window(acc, t_end, t_end + after)
    n = {c.split("=")[0]: int(c.split("=")[1]) for c in counts if c.split("=")[1].isdigit()}
    share = sum(n.values()) / max(1, len(n))
    far = max(abs(v - share) / share * 100 for v in n.values()) if n and share else None
    rows.append(dict(mode=mode, r=r, balanced=balanced == "yes", took=t_end - t_join, counts=" ".join(counts),
                     far=far, pre=pre, during=during, low=low, post=post, moved=moved, errors=errors))

print()
print("| rebalancing | round | time to balance | targets at the end | farthest from its share | "
      "guest IOPS before | during | after | lowest second during | during / before | agents moved | errors |")
print("| --- | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
for x in rows:
    took = f"{x['took']:.1f} s" if x["balanced"] else f"never ({x['took']:.1f} s watched)"
    ratio = x["during"] / x["pre"] if x["during"] is not None and x["pre"] else None
    print(f"| {x['mode']} | {x['r']} | {took} | {x['counts']} | {fmt(x['far'])}% | "
          f"{fmt(x['pre'])} | {fmt(x['during'])} | {fmt(x['post'])} | {fmt(x['low'])} | {fmt(ratio, '.2f')} | "
          f"{x['moved']} | {x['errors']} |")
print()
on = [x for x in rows if x["mode"] == "on"]
off = {x["r"]: x for x in rows if x["mode"] == "off"}
ratios = {k: [] for k in ("pre", "during", "post")}
for x in on:
    y = off.get(x["r"])
    for k in ratios:
        if y and x[k] is not None and y[k]:
            ratios[k].append(x[k] / y[k])
took = [x["took"] for x in on if x["balanced"]]
print(f"- time to balance (every server within {tol:.0f}% of its share) after b and c start: "
      + (f"median {statistics.median(took):.1f} s over {len(took)} of {len(on)} run(s)" if took else "never")
      + "; without rebalancing: " + ("never" if not any(x["balanced"] for x in off.values()) else "balanced by placement alone"))
print("- guest IOPS of the fio agents with rebalancing over without, same windows (median over rounds): "
      + ", ".join(f"{name} {fmt(statistics.median(v) if v else None, '.2f')}"
                  for name, v in (("before", ratios["pre"]), ("during", ratios["during"]), ("after", ratios["post"]))))
PYEOF
