#!/usr/bin/env bash
# A diskless machine boots the golden image from the network, as a lab PC does: qemu's
# iPXE ROM (Debian's ipxe-qemu) gets `vdstream server --boot`'s /boot/ipxe from qemu's
# user-mode DHCP, chains to its own script by MAC, loads the kernel and the initramfs the
# server built from the vDisk version's own /boot and /lib/modules, the initramfs attaches
# the vDisk to /dev/nbd0 with the write cache in the machine's RAM (ram-overflow) and
# switch_roots to the golden image's test init, which writes a file with sync. Then:
#   - it reboots clean: the second boot of the same machine does not see the first boot's
#     file (the cache lived in the machine's RAM);
#   - a second machine with another MAC, booting at the same time, gets its own hostname
#     and machine-id from its record;
#   - the vDisk still holds the golden image's bytes (qemu-img compare over NBD);
#   - boot pacing (--max-booting 1): of the two machines booting together, one waits in
#     iPXE (its console says "waiting: 1 booting") until the other's initramfs has mounted
#     its root and said so (`target booted`): never two in their boot window at once.
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
require qemu-img
pxe_test_init golden

mac1=$(pxe_mac 1) mac2=$(pxe_mac 2)
vds target add pc1 --vdisk golden --cache ram-overflow --ram 64M --mac "$mac1" --hostname lab-pc-1 >/dev/null
vds target add pc2 --vdisk golden --cache ram-overflow --ram 64M --mac "$mac2" >/dev/null
PXE_KERNEL_ARGS="$PXE_KERNEL_ARGS vdstest=write vdstest.mb=4"
start_boot_server --max-booting 1
metric() { curl -sf --max-time 5 "$BOOT_API/metrics" | awk -v m="$1" '$1 == m { print $2 }'; }

host_line() { grep -aom1 'VDSTEST HOST .*' "$E2E_TMP/$1.serial" | tr -d '\r'; }

start=$SECONDS
pxe_boot pc1-first "$mac1"
log "pc1 booted from the network in $(vm_secs pc1-first) s (qemu start to power-off; init at uptime $(booted_uptime pc1-first) s)"
serial_has pc1-first '^VDSTEST WROTE boot mb=4' || fail "pc1 did not write its file"
serial_has pc1-first '^VDSTEST SEES ' && fail "pc1's first boot saw files of an earlier boot"
line=$(host_line pc1-first)
[[ $line =~ name=lab-pc-1\ machine_id=([0-9a-f]{32})\ root=/dev/nbd0 ]] ||
    fail "pc1: want hostname lab-pc-1, a machine-id and /dev/nbd0 as root, got: $line"
id1=${BASH_REMATCH[1]}
log "ok: pc1: $line"
serial_has pc1-first 'vdstream-init: attaching' || fail "the initramfs's /init did not attach the vDisk"
# After switch_root the agent goes on writing its status file where the booted system sees
# it (/run/vdstream), and the serial console is plain text: no colour codes, no warning.
serial_has pc1-first '^VDSTEST AGENT-STATUS pc1.status.json state=running fresh=yes' ||
    fail "pc1's agent status after switch_root: $(grep -a 'AGENT-STATUS' "$E2E_TMP/pc1-first.serial" || echo none)"
# (vdstream's lines only: the firmware and iPXE colour theirs.)
grep -a vdstream "$E2E_TMP/pc1-first.serial" | grep -aqE $'\x1b\\[[0-9;]*m' &&
    fail "pc1's serial console has ANSI colour codes in vdstream's lines: $(grep -a vdstream "$E2E_TMP/pc1-first.serial" | grep -aE $'\x1b\\[[0-9;]*m' | head -n2 | cat -v)"
grep -aq 'status file' "$E2E_TMP/pc1-first.serial" && fail "pc1's serial console warns about the status file: $(grep -a 'status file' "$E2E_TMP/pc1-first.serial")"
log "ok: pc1's agent writes its status under the booted system's /run; the console is plain text"

# The same machine again, and a second machine, at the same time.
pxe_start pc1-again "$mac1"
pid_again=$VM_PID
pxe_start pc2 "$mac2"
pid2=$VM_PID
wait_vm pc1-again "$pid_again"
wait_vm pc2 "$pid2"
serial_has pc1-again '^VDSTEST SEES ' && fail "pc1's second boot saw the first boot's file: its RAM cache was not new"
serial_has pc1-again '^VDSTEST WROTE boot mb=4' || fail "pc1's second boot did not write its file"
log "ok: pc1 rebooted clean (no file of the first boot)"
line=$(host_line pc2)
[[ $line =~ name=pc2\ machine_id=([0-9a-f]{32})\ root=/dev/nbd0 ]] ||
    fail "pc2: want hostname pc2 (its id), a machine-id and /dev/nbd0 as root, got: $line"
[[ ${BASH_REMATCH[1]} != "$id1" ]] || fail "pc1 and pc2 got the same machine-id $id1"
[[ $(host_line pc1-again) == *"machine_id=$id1 "* ]] || fail "pc1's machine-id changed between boots: $(host_line pc1-again)"
log "ok: pc2: $line"
# Pacing: each boot's window was closed by its initramfs, never two at once, and the
# machine that came second was told to wait on its console.
assert_eq "boot windows closed by their machine" "$(metric vdstream_boot_booted_total)" 3
assert_eq "the most machines in their boot window at once" "$(metric vdstream_boot_booting_peak)" 1
grep -aq 'vdstream: waiting: 1 booting (at most 1 at once)' "$E2E_TMP/pc1-again.serial" "$E2E_TMP/pc2.serial" ||
    fail "neither machine of the pair was told to wait (--max-booting 1)"
grep -aq 'vdstream-init: warning' "$E2E_TMP/pc2.serial" && fail "pc2's initramfs warned: $(grep -a 'vdstream-init: warning' "$E2E_TMP/pc2.serial")"
log "ok: paced: one machine waited in iPXE; every initramfs said it booted"
log "three network boots in $((SECONDS - start)) s"

# Every write stayed in the machines: the vDisk still serves the golden image.
qemu-img compare -q -f raw -F raw "$GOLDEN/golden.img" "nbd://$BOOT_NBD/vdisk/golden" ||
    fail "the vDisk no longer serves the golden image's bytes"
log "ok: the vDisk is unchanged"
rc=0
stop_server "$SERVER_PID" 15 || rc=$?
assert_eq "server exit status" "$rc" 0
