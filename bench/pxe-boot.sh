#!/usr/bin/env bash
# bench/pxe-boot.sh — diskless machines that boot from the network (`vdstream server
# --boot`), against the agent-on-the-host path of the VM tests, in one run:
#
#   boot    one machine boots the golden image to its test init and powers off
#           (vdstest=boot), --boots times each, alternately: (a) diskless, qemu's iPXE ROM
#           on qemu's user-mode network: /boot/ipxe, its script, kernel and initramfs over
#           HTTP, the agent inside the machine, root on /dev/nbd0; (b) the VM path: a
#           `ram-overflow` agent on the host, qemu's -kernel/-initrd and the agent's socket
#           as its disk. Wall seconds from qemu's start to the power-off (the test init
#           powers off at once, so this is power-on to init), medians and their ratio.
#   storm   one machine boots alone from a fresh server, then --targets machines at once
#           from another fresh server: store reads (GET /api/v1/server) for one machine,
#           for the storm, and per booted machine.
#   fio     the VDI profile (shared/bench/vdi.fio) inside the guest, on a 64 MiB file of
#           its root (libaio, O_DIRECT, --fio-secs seconds), --fio-rounds times each,
#           alternately: (a) the diskless PXE machine, its ram-overflow cache (--ram 128M)
#           in its own RAM and its agent on its own (emulated) CPU; (b) the same guest on
#           the VM path, a ram-overflow --ram 128M agent on the host. Guest-visible IOPS,
#           medians and their ratio. Under TCG the guest's emulated CPU runs fio, its
#           kernel and (PXE) the agent: the figure measures the emulator as much as the
#           data path.
#
# Every section boots a golden image that also carries fio (make-golden-image --fio, in
# target/golden-image-fio; the host's fio and its libraries are copied in).
#
# Usage: bench/pxe-boot.sh [--boots 3] [--targets 8] [--fio-rounds 3] [--fio-secs 30]
#                          [--only boot|storm|fio]
# Environment: VDSTREAM_BIN, VDSTREAM_VM_ACCEL (tcg|kvm; default: probed), TMPDIR.
# Under TCG the guest's own CPU (the emulator) dominates every figure: read the ratio.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"
boots=3 targets=8 fio_rounds=3 fio_secs=30 only=
args_given="$*"
while (($#)); do
    case $1 in
    --boots) boots=$2; shift ;;
    --targets) targets=$2; shift ;;
    --only) only=$2; shift ;;
    --fio-rounds) fio_rounds=$2; shift ;;
    --fio-secs) fio_secs=$2; shift ;;
    -h | --help) bench_help ;;
    *) bench_bad_arg "$1" ;;
    esac
    shift
done

# shellcheck source=../tests/e2e/lib.sh
source "$ROOT/tests/e2e/lib.sh"
# shellcheck source=../tests/e2e/store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=../tests/e2e/server-lib.sh
source "$E2E_DIR/server-lib.sh"
# shellcheck source=../tests/e2e/agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
# shellcheck source=../tests/e2e/vm-lib.sh
source "$E2E_DIR/vm-lib.sh"
# shellcheck source=../tests/e2e/pxe-lib.sh
source "$E2E_DIR/pxe-lib.sh"
VM_SECS=${VDSTREAM_VM_SECS:-600}
need_jobfile
GOLDEN=$REPO_ROOT/target/golden-image-fio
GOLDEN_FIO=$JOBFILE
pxe_test_init golden
echo "# bench/pxe-boot.sh $args_given"
echo "# $(date -u +%FT%TZ), $(nproc) cores, -accel $(vm_accel), load average $(cut -d' ' -f1-3 /proc/loadavg)"
want() { [[ -z $only || $only == "$1" ]]; }
median() { sort -n "$1" | awk '{ v[NR] = $1 } END { printf "%.1f", (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
# report_pair TITLE LABEL_A FILE_A LABEL_B FILE_B WHAT UNIT — a section: both peers' values
# (one a line in FILE_A, FILE_B) with their medians, and the ratio of the medians, A / B.
report_pair() {
    local a b
    a=$(median "$3") b=$(median "$5")
    echo
    echo "## $1"
    echo "$2: $(paste -sd' ' "$3") (median $a$7)"
    echo "$4: $(paste -sd' ' "$5") (median $b$7)"
    awk -v a="$a" -v b="$b" -v w="$6" 'BEGIN { printf "PXE / agent on the host: %.2fx the %s\n", a / b, w }'
}
store_reads() { curl -sS --max-time 10 "$BOOT_API/api/v1/server" | json_get /dev/stdin 'j["io"]["store"]["read_bytes"]'; }

for ((i = 0; i <= targets; i++)); do
    vds target add "pxe$i" --vdisk golden --cache ram-overflow --ram 32M --mac "$(pxe_mac $((0x200 + i)))" >/dev/null
done

if want boot; then
    start_boot_server
    pxe_boot warm "$(pxe_mac 0x200)" # builds and caches the version's initramfs first
    : >"$E2E_TMP/pxe.secs"
    : >"$E2E_TMP/agent.secs"
    for ((b = 1; b <= boots; b++)); do
        pxe_boot "pxe-b$b" "$(pxe_mac 0x200)"
        vm_secs "pxe-b$b" >>"$E2E_TMP/pxe.secs"; echo >>"$E2E_TMP/pxe.secs"
        start_agent "host$b" --server "$(xuri vdisk/golden)" --cache ram-overflow --ram 32M
        boot_vm "host$b" "$URI" vdstest=boot
        vm_secs "host$b" >>"$E2E_TMP/agent.secs"; echo >>"$E2E_TMP/agent.secs"
        stop_server "$AGENT_PID" 15 || fail "agent host$b did not stop cleanly"
    done
    report_pair "boot: one machine, $boots boots each (wall seconds, qemu start to power-off)" \
        "diskless PXE (iPXE ROM, HTTP, agent in the machine)" "$E2E_TMP/pxe.secs" \
        "agent on the host (qemu -kernel, agent socket)     " "$E2E_TMP/agent.secs" "boot time" " s"
    stop_server "$SERVER_PID" 15 || fail "the server did not stop cleanly"
fi

if want storm; then
    PXE_KERNEL_ARGS="$PXE_KERNEL_ARGS vdstest=write vdstest.mb=1"
    start_boot_server
    pxe_boot alone "$(pxe_mac 0x200)"
    one=$(store_reads)
    stop_server "$SERVER_PID" 15 || fail "the server did not stop cleanly"
    start_boot_server
    start=$SECONDS
    pids=()
    for ((i = 1; i <= targets; i++)); do
        pxe_start "pxe$i" "$(pxe_mac $((0x200 + i)))"
        pids+=("$VM_PID")
    done
    for ((i = 1; i <= targets; i++)); do wait_vm "pxe$i" "${pids[i - 1]}"; done
    wall=$((SECONDS - start))
    storm=$(store_reads)
    for ((i = 1; i <= targets; i++)); do vm_secs "pxe$i"; echo; done >"$E2E_TMP/storm.secs"
    echo
    echo "## storm: $targets diskless machines PXE-boot at once ($wall s to the last power-off)"
    echo "boot s: min $(sort -n "$E2E_TMP/storm.secs" | head -n1), median $(median "$E2E_TMP/storm.secs"), max $(sort -n "$E2E_TMP/storm.secs" | tail -n1); failures: 0 of $targets"
    awk -v one="$one" -v s="$storm" -v n="$targets" 'BEGIN {
        printf "store reads: one machine alone %d KiB; %d at once %d KiB = %.2fx one machine, %.0f KiB (%.2f of one machine) per booted machine\n",
            one / 1024, n, s / 1024, s / one, s / n / 1024, s / n / one }'
    stop_server "$SERVER_PID" 15 || fail "the server did not stop cleanly"
fi

if want fio; then
    # fio_iops NAME — the guest's `VDSTEST FIO iops=N` figure.
    fio_iops() {
        sed -n 's/.*VDSTEST FIO iops=\([0-9]*\).*/\1/p' "$E2E_TMP/$1.serial" | tail -n1 | grep . ||
            fail "machine $1 printed no FIO line (console: $E2E_TMP/$1.serial)"
    }
    fio_args="vdstest=fio vdstest.secs=$fio_secs vdstest.fio_size=64m"
    vds target add fio-pxe --vdisk golden --cache ram-overflow --ram 128M --mac "$(pxe_mac 0x2ff)" >/dev/null
    PXE_KERNEL_ARGS="$PXE_KERNEL_ARGS $fio_args"
    start_boot_server
    : >"$E2E_TMP/fio-pxe.iops"
    : >"$E2E_TMP/fio-host.iops"
    for ((r = 1; r <= fio_rounds; r++)); do
        pxe_boot "fio-pxe$r" "$(pxe_mac 0x2ff)"
        fio_iops "fio-pxe$r" >>"$E2E_TMP/fio-pxe.iops"
        start_agent "fio-host$r" --server "$(xuri vdisk/golden)" --cache ram-overflow --ram 128M
        boot_vm "fio-host$r" "$URI" "$fio_args"
        fio_iops "fio-host$r" >>"$E2E_TMP/fio-host.iops"
        stop_server "$AGENT_PID" 15 || fail "agent fio-host$r did not stop cleanly"
    done
    report_pair "fio: the VDI profile inside the guest ($fio_secs s, 64 MiB file, libaio, O_DIRECT), $fio_rounds rounds each, IOPS" \
        "diskless PXE (cache and agent in the machine, ram-overflow 128M)" "$E2E_TMP/fio-pxe.iops" \
        "agent on the host (ram-overflow 128M, agent socket)            " "$E2E_TMP/fio-host.iops" "guest-visible IOPS" ""
    stop_server "$SERVER_PID" 15 || fail "the server did not stop cleanly"
fi
