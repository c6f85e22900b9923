#!/usr/bin/env bash
# A network-booted machine with a small local disk: its write cache is 16 MiB of its own
# RAM with overflow to that disk (`target add --ram 16M --overflow-device /dev/vda`: the
# initramfs hands it to the agent, which formats it at every boot). The golden image's file
# workload (a tar copy of a module tree, 200 small files with syncs, removal, fstrim: over
# 40 MiB of writes, more than the RAM cache) completes; the machine then remounts its root
# read-only and copies it to a spare drive, and the host's e2fsck finds that file system
# clean; the vDisk's bytes are the same before and after (sha256 over NBD); the scratch
# disk was really used (the agent wrote its overflow there).
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
require qemu-img e2fsck nbdcopy
pxe_test_init golden

mac=$(pxe_mac 3)
vds target add ws1 --vdisk golden --cache ram-overflow --ram 16M --overflow-device /dev/vda --mac "$mac" >/dev/null
PXE_KERNEL_ARGS="$PXE_KERNEL_ARGS vdstest=workload vdstest.rounds=2 vdstest.fstrim=1 vdstest.dump=/dev/vdb"
start_boot_server
vdisk_sum() { nbdcopy "nbd://$BOOT_NBD/vdisk/golden" - | sha256sum | cut -d' ' -f1; }
before=$(vdisk_sum)

truncate -s 256M "$E2E_TMP/scratch.img"
truncate -s "$(stat -c %s "$GOLDEN/golden.img")" "$E2E_TMP/root-copy.img"
pxe_boot ws1 "$mac" -drive "file=$E2E_TMP/scratch.img,format=raw,if=virtio" \
    -drive "file=$E2E_TMP/root-copy.img,format=raw,if=virtio"
log "ws1: booted and ran the workload in $(vm_secs ws1) s"
serial_has ws1 '^VDSTEST WORKLOAD round=2 ' || fail "the workload did not finish its rounds"
serial_has ws1 '^VDSTEST FSTRIM /: [0-9]+ bytes trimmed' || fail "fstrim did not run"
serial_has ws1 '^VDSTEST KERNEL-IO-ERRORS n=0' || fail "the guest's kernel logged I/O errors: $(grep -a 'KERNEL-IO' "$E2E_TMP/ws1.serial")"
serial_has ws1 '^VDSTEST DUMPED /dev/nbd0 to /dev/vdb' || fail "the root was not copied to the spare drive"
e2fsck -fn "$E2E_TMP/root-copy.img" >"$E2E_TMP/fsck.log" 2>&1 || { cat "$E2E_TMP/fsck.log" >&2; fail "e2fsck -fn found errors in the machine's root"; }
log "ok: e2fsck -fn: the machine's root is clean after the workload: $(tail -n1 "$E2E_TMP/fsck.log")"

# The overflow went to the scratch disk: it holds data now (it was all holes).
used=$(du -k "$E2E_TMP/scratch.img" | cut -f1)
((used > 16384)) || fail "the scratch disk holds only $used KiB, less than the 16 MiB RAM cache: the cache did not overflow to it"
log "ok: the overflow disk holds $((used / 1024)) MiB after a workload through a 16 MiB RAM cache"

after=$(vdisk_sum)
assert_eq "the vDisk's sha256 after the workload" "$after" "$before"
rc=0
stop_server "$SERVER_PID" 15 || rc=$?
assert_eq "server exit status" "$rc" 0
