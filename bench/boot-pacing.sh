#!/usr/bin/env bash
# bench/boot-pacing.sh — a boot storm with and without boot pacing (`vdstream server --boot
# --max-booting N`): --machines simulated machines (tests/e2e/pacing-lib.sh: each one's agent
# asks for a boot place with `target attach --booting`, reads its whole --mib MiB vDisk
# through the agent, says `target booted` and stops) start at once against one store
# server, for each --max values (0: no pacing), in turn, --rounds times. Per run: the
# time until every machine booted, the median and longest time a machine took to get its
# disk, the most machines in their boot window at once (the server's peak), and errors.
# The peer is the same storm without pacing (--max 0), in the same run.
#
# Usage: bench/boot-pacing.sh [--machines 200] [--mib 16] [--max 0,25,50,100] [--rounds 2]
# Environment: VDSTREAM_BIN (default target/release/vdstream), VDSTREAM_E2E_KEEP=1, TMPDIR.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"
machines=200 mib=16 maxes=0,25,50,100 rounds=2
args_given="$*"
while (($#)); do
    case $1 in
    --machines) machines=$2; shift ;;
    --mib) mib=$2; shift ;;
    --max) maxes=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    -h | --help) bench_help ;;
    *) bench_bad_arg "$1" ;;
    esac
    shift
done
need_vdstream
need_cmds nbdcopy cmp curl

# shellcheck source=../tests/e2e/lib.sh
source "$ROOT/tests/e2e/lib.sh"
# shellcheck source=../tests/e2e/store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=../tests/e2e/server-lib.sh
source "$E2E_DIR/server-lib.sh"
# shellcheck source=../tests/e2e/agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
# shellcheck source=../tests/e2e/pacing-lib.sh
source "$E2E_DIR/pacing-lib.sh"
e2e_init
echo "# bench/boot-pacing.sh $args_given"
echo "# $(date -u +%FT%TZ), $(nproc) cores, $machines machines, a $mib MiB vDisk each reads whole"
pacing_setup "$machines" "$mib"
printf '%-12s %5s %14s %16s %16s %6s %7s\n' max round all-booted-s median-to-disk-s longest-to-disk-s peak errors
for ((r = 1; r <= rounds; r++)); do
    for max in ${maxes//,/ }; do
        pacing_server "$max"
        pacing_storm "$machines" "$E2E_TMP/storm-$max-$r.txt" >"$E2E_TMP/summary-$max-$r.txt"
        peak=$(pacing_metric vdstream_boot_booting_peak)
        stop_server "$SERVER_PID" 15 >/dev/null || true
        "$PY" - "$E2E_TMP/storm-$max-$r.txt" "$max" "$r" "$peak" <<'PYEOF'
import sys
rows = [l.split() for l in open(sys.argv[1])]
t0 = min(float(r[1]) for r in rows)
end = max(float(r[3]) for r in rows)
to_disk = sorted(float(r[2]) - float(r[1]) for r in rows)
bad = sum(r[4] != "0" for r in rows)
label = "no pacing" if sys.argv[2] == "0" else sys.argv[2]
print(f"{label:<12} {sys.argv[3]:>5} {end - t0:>14.1f} {to_disk[len(to_disk) // 2]:>16.1f} {to_disk[-1]:>16.1f} {sys.argv[4]:>6} {bad:>7}")
PYEOF
    done
done
