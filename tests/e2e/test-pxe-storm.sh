#!/usr/bin/env bash
# A boot storm of diskless machines: first one machine boots alone from a fresh server
# (what one target makes the server read from the store), then N (VDSTREAM_PXE_STORM,
# default 8) machines with their own MACs and records PXE-boot at the same time from
# another fresh server, each writing 1 MiB with sync. All boot; the store was read about
# once for all of them (the server's shared read cache: store reads at most twice the lone
# machine's), as test-vm-boot-storm.sh shows for VMs on a host's agent. Reports each boot
# time and the reads (GET /api/v1/server).
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=server-lib.sh
source "$E2E_DIR/server-lib.sh"
# shellcheck source=vm-lib.sh
source "$E2E_DIR/vm-lib.sh"
# shellcheck source=pxe-lib.sh
source "$E2E_DIR/pxe-lib.sh"
pxe_test_init golden
N=${VDSTREAM_PXE_STORM:-8}
PXE_KERNEL_ARGS="$PXE_KERNEL_ARGS vdstest=write vdstest.mb=1"
for ((i = 0; i <= N; i++)); do
    vds target add "st$i" --vdisk golden --cache ram-overflow --ram 32M --mac "$(pxe_mac $((0x100 + i)))" >/dev/null
done
store_reads() { curl -sS --max-time 10 "$BOOT_API/api/v1/server" | json_get /dev/stdin 'j["io"]["store"]["read_bytes"]'; }

# One machine alone (its initramfs is built and cached here, before the storm).
start_boot_server
pxe_boot st0 "$(pxe_mac 0x100)"
one=$(store_reads)
log "one machine alone: booted in $(vm_secs st0) s, the store was read $((one >> 10)) KiB"
((one > 0)) || fail "the lone boot read nothing from the store"
stop_server "$SERVER_PID" 15 || fail "the first server did not stop cleanly"

start_boot_server
start=$SECONDS
pids=()
for ((i = 1; i <= N; i++)); do
    pxe_start "st$i" "$(pxe_mac $((0x100 + i)))"
    pids+=("$VM_PID")
done
for ((i = 1; i <= N; i++)); do wait_vm "st$i" "${pids[i - 1]}"; done
storm=$(store_reads)
secs=$(for ((i = 1; i <= N; i++)); do vm_secs "st$i"; echo; done | sort -n | tr '\n' ' ')
log "$N machines booted at once in $((SECONDS - start)) s; boot seconds: $secs"
"$PY" - "$one" "$storm" "$N" <<'PYEOF' || fail "the store was not read about once for the storm"
import sys
one, storm, n = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
print(f"store reads: one machine {one >> 10} KiB, {n} machines at once {storm >> 10} KiB = {storm / one:.2f}x one machine's, "
      f"{storm / n / 1024:.0f} KiB per booted machine")
assert storm <= 2 * one, f"{storm} > 2 x {one}"
PYEOF
log "ok: the store was read about once for $N machines"
rc=0
stop_server "$SERVER_PID" 15 || rc=$?
assert_eq "server exit status" "$rc" 0
