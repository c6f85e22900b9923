#!/usr/bin/env bash
# bench/size-guest-workload.sh — RAM sizing advice for a real guest: a Linux VM boots from
# the golden image (scripts/make-golden-image, docs/BOOT.md) through an agent that records
# its I/O (`target attach --record-trace`), runs the guest workload (vdstest=workload: a
# tar copy of /usr/lib/modules, 200 small files with syncs, a log, rm, then fstrim), and
# powers off; then `vdstream size` replays the trace at several RAM sizes. Prints the
# trace's request counts and the sizing table, and writes the chart.
#
#   serve-image GOLDEN/golden.img --read-only          (the vDisk)
#   target attach vm1 --cache ram-overflow --ram 256M --record-trace TRACE
#   qemu-system-x86_64 -accel ACCEL -m 192M ... vdstest=workload vdstest.fstrim=1
#   vdstream size --trace TRACE --ram RAMS --chart OUT.svg
#
# Usage: bench/size-guest-workload.sh [--golden DIR] [--ram 4M,16M,64M,256M] [--rounds 3]
#                                     [--accel tcg|kvm] [--keep DIR] [--chart FILE.svg]
#   --chart FILE  where the chart goes (default target/size-guest-workload.svg)
#   --golden DIR  the golden image (vmlinuz, initrd.img, golden.img, cmdline); default:
#                 target/golden-image, built with scripts/make-golden-image when missing
#   --rounds N    the workload's vdstest.rounds (default 3)
#   --keep DIR    keep the trace and the size report (JSON) in DIR
# Environment: VDSTREAM_BIN, TMPDIR.

set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"

golden=$ROOT/target/golden-image rams=4M,16M,64M,256M rounds=3 accel=tcg keep='' chart=''
args_given="$*"
while (($#)); do
    case $1 in
    --golden) golden=$2; shift ;;
    --ram) rams=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --accel) accel=$2; shift ;;
    --keep) keep=$2; shift ;;
    --chart) chart=$2; shift ;;
    -h | --help) bench_help ;;
    *) bench_bad_arg "$1" ;;
    esac
    shift
done
need_vdstream
command -v qemu-system-x86_64 >/dev/null || { echo "qemu-system-x86_64 is not installed (Debian: qemu-system-x86)" >&2; exit 2; }
if [[ ! -f $golden/golden.img ]]; then
    [[ -x $ROOT/scripts/make-golden-image ]] ||
        { echo "no golden image in $golden and no scripts/make-golden-image to build one (see docs/BOOT.md)" >&2; exit 2; }
    "$ROOT/scripts/make-golden-image" "$golden" >&2
fi

work=$(mktemp -d "${TMPDIR:-/tmp}/vdstream-size-guest.XXXXXX")
server_pid='' agent_pid=''
BENCH_PID_VARS="agent_pid server_pid"
bench_cleanup_on_exit
export VDSTREAM_RUN_DIR=$work/run VDSTREAM_CACHE_DIR=$work/cache
trace=$work/guest.trace
chart=${chart:-$ROOT/target/size-guest-workload.svg}

"$VDSTREAM_BIN" serve-image "$golden/golden.img" --read-only --socket "$work/golden.sock" >"$work/server.log" 2>&1 </dev/null &
server_pid=$!
wait_nbd_ready "$server_pid" "$work/golden.sock" "$work/server.log" serve-image 30 || exit 1
"$VDSTREAM_BIN" target attach vm1 --server "nbd+unix:///?socket=$work/golden.sock" \
    --cache ram-overflow --ram 256M --record-trace "$trace" >"$work/agent.log" 2>&1 </dev/null &
agent_pid=$!
wait_nbd_ready "$agent_pid" "$work/run/vm1.sock" "$work/agent.log" agent 30 || exit 1

echo "booting the guest ($accel): vdstest=workload vdstest.rounds=$rounds vdstest.fstrim=1" >&2
start=$SECONDS
timeout --kill-after=10 900 qemu-system-x86_64 -accel "$accel" -m 192M -smp 1 -nographic -no-reboot \
    -nic none -monitor none -serial "file:$work/guest.serial" \
    -kernel "$golden/vmlinuz" -initrd "$golden/initrd.img" \
    -append "$(cat "$golden/cmdline") vdstest=workload vdstest.rounds=$rounds vdstest.fstrim=1" \
    -drive "file=nbd+unix:///?socket=$work/run/vm1.sock,format=raw,if=virtio,discard=unmap" </dev/null ||
    { tail -n 20 "$work/guest.serial" >&2; echo "qemu failed or timed out" >&2; exit 1; }
grep -q 'VDSTEST DONE status=ok' "$work/guest.serial" ||
    { tail -n 20 "$work/guest.serial" >&2; echo "the guest workload did not finish ok" >&2; exit 1; }
guest_secs=$((SECONDS - start))
stop_pid "$agent_pid"
agent_pid=''
grep "recorded" "$work/agent.log" >&2 || { cat "$work/agent.log" >&2; echo "the agent wrote no trace" >&2; exit 1; }

"$VDSTREAM_BIN" size --trace "$trace" --ram "$rams" --json --chart "$chart" >"$work/size.json"
table=$("$VDSTREAM_BIN" size --trace "$trace" --ram "$rams")
if [[ -n $keep ]]; then mkdir -p "$keep" && cp "$trace" "$work/size.json" "$work/guest.serial" "$keep"/; fi

echo "### RAM sizing for the guest workload (\`vdstream size\` on a recorded trace)"
echo
echo "\`bench/size-guest-workload.sh ${args_given}\` — $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, qemu $accel,"
echo "guest ran ${guest_secs} s: $(grep -c '^VDSTEST WORKLOAD' "$work/guest.serial") workload rounds, $(grep -o 'FSTRIM.*' "$work/guest.serial" | head -n1)."
echo "The second run of \`vdstream size\` (the table) is a separate replay of the same trace."
echo
echo '```text'
echo "$table"
echo '```'
echo "chart: $chart" >&2
