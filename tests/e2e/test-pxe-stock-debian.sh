#!/usr/bin/env bash
# A stock-layout Debian image network-boots (scripts/make-stock-image): Debian's generic
# kernel package with its FULL module tree, where ext4, jbd2 and the crc32c drivers are
# modules, and an ext4 root made by Debian's mkfs.ext4 with its default features
# (metadata_csum among them). Mounting that root needs a crc32c driver, which ext4 and jbd2
# ask the crypto API for at mount time (their softdep "pre: crypto-crc32c", an alias that
# crc32c_generic and crc32c_intel answer). The initramfs the boot service builds has no
# modprobe: it must carry and load those modules itself.
#
# A diskless machine (qemu's iPXE ROM, the write cache in its RAM) boots the image through
# `vdstream server --boot`; it must mount its root from /dev/nbd0 read-write as ext4 and
# reach the image's own /sbin/init, which reports its kernel, the modules it sees (all of
# the package's) and the crc32c driver the kernel uses.
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
require_vdstream
e2e_init
E2E_CLEANUP_HOOKS+=(pxe_keep_logs)
require_pxe_tools
start=$SECONDS
stock_image
log "stock-layout image $STOCK_IMG (kernel $STOCK_KVER), ready in $((SECONDS - start)) s"

# The image is what this test says it is.
features=$(dumpe2fs -h "$STOCK_IMG" 2>/dev/null | sed -n 's/^Filesystem features: *//p')
for f in metadata_csum 64bit; do
    [[ " $features " == *" $f "* ]] || fail "the stock image's ext4 lacks $f (mkfs.ext4's default features): $features"
done
nmods=$(find "$STOCK_MODULES" -name '*.ko*' | wc -l)
((nmods > 3000)) || fail "the stock image has $nmods modules: not a kernel package's full tree"
for m in kernel/fs/ext4/ext4.ko kernel/fs/jbd2/jbd2.ko kernel/crypto/crc32c_generic.ko; do
    [[ -f $STOCK_MODULES/$m ]] || fail "$m is not a module of $STOCK_KVER: this test would not test what it says"
done
grep -q '^softdep ext4 pre: crypto-crc32c' "$STOCK_MODULES/modules.softdep" ||
    fail "$STOCK_MODULES/modules.softdep does not name ext4's crc32c"
log "ok: ext4 features: $features; $nmods modules"

store_init
start=$SECONDS
vds vdisk import stock "$STOCK_IMG" >/dev/null || fail "vdstream vdisk import stock $STOCK_IMG failed"
log "imported in $((SECONDS - start)) s"
mac=$(pxe_mac 1)
vds target add pc1 --vdisk stock --cache ram-overflow --ram 64M --mac "$mac" >/dev/null
# The console and clock arguments of the golden image's boots (vm-lib.sh says why); no
# vdstest mode (the stock image's init has one); a failed boot powers off at once.
PXE_KERNEL_ARGS="console=ttyS0 panic=-1 quiet no_timer_check tsc=unstable vdstream.on_fail=halt"
start_boot_server

start=$SECONDS
pxe_start pc1 "$mac"
pid=$VM_PID
for ((i = 0; i < VM_SECS * 10; i++)); do
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.1
done
serial_line() { grep -a "$1" "$E2E_TMP/pc1.serial" | tr -d '\r' | head -n3 | paste -sd'|'; }
serial_has pc1 'Cannot load crc32c' && fail "the guest's kernel could not load crc32c: $(serial_line 'EXT4-fs\|vdstream-init: FAILED')"
serial_has pc1 'vdstream-init: FAILED' && fail "the initramfs failed: $(serial_line 'vdstream-init: FAILED')"
wait_vm pc1 "$pid" 1
log "the stock image network-booted in $(vm_secs pc1) s (qemu start to power-off; its init at uptime $(booted_uptime pc1) s)"

line() { grep -aom1 "^VDSTEST STOCK $1.*" "$E2E_TMP/pc1.serial" | tr -d '\r'; }
serial_has pc1 'vdstream-init: warning: insmod' && fail "an insmod failed: $(serial_line 'vdstream-init: warning: insmod')"
root=$(line root=)
[[ $root =~ ^VDSTEST\ STOCK\ root=/dev/nbd0\ fstype=ext4\ opts=rw, ]] ||
    fail "want the root mounted from /dev/nbd0 as ext4 read-write, got: ${root:-no STOCK root line}"
log "ok: $root"
seen=$(line kernel=)
[[ $seen == "VDSTEST STOCK kernel=$STOCK_KVER modules=$nmods marker=stock-debian-$STOCK_KVER" ]] ||
    fail "want the image's kernel $STOCK_KVER, its $nmods modules and its marker, got: ${seen:-no STOCK kernel line}"
log "ok: $seen"
crc=$(line crc32c=)
[[ $crc =~ crc32c= ]] && [[ ${crc#*crc32c=} =~ crc32c ]] || fail "the guest's kernel has no crc32c driver: ${crc:-no STOCK crc32c line}"
log "ok: $crc"
# What the boot service put in the initramfs (its log names the modules).
grep -a 'boot: vDisk stock' "$SERVER_LOG" | grep -q 'crc32c_generic' ||
    fail "the boot service's log does not list crc32c_generic among the initramfs's modules: $(grep -a 'boot: vDisk stock' "$SERVER_LOG")"
log "network boot of a stock-layout image in $((SECONDS - start)) s"
rc=0
stop_server "$SERVER_PID" 15 || rc=$?
assert_eq "server exit status" "$rc" 0
