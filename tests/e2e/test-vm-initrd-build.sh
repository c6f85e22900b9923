#!/usr/bin/env bash
# `vdstream initrd build` on the golden image: the version's own kernel is copied out, the
# initramfs lists /init, a static busybox, vdstream with its libraries and the network-boot
# modules in dependency order; exit statuses for a version without a kernel (3), an
# unknown vDisk (3) and a module the kernel lacks (1). Then the initramfs boots a VM under
# qemu's user-mode network: /init gets a DHCP lease and starts the agent with the
# kernel-command-line contract (what happens next is the agent's and the boot tests').
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=vm-lib.sh
source "$E2E_DIR/vm-lib.sh"
require cpio gzip mkfs.ext4
vm_test_init golden

out=$E2E_TMP/boot
mkdir -p "$out"
rc=0
vds initrd build --vdisk golden --out "$out/initrd.img" --kernel-out "$out/vmlinuz" --json \
    >"$out/build.json" 2>"$out/build.err" || rc=$?
((rc == 0)) || { cat "$out/build.err" >&2; fail "initrd build exited $rc"; }
cmp -s "$out/vmlinuz" "$GOLDEN/vmlinuz" || fail "the kernel copied out is not the image's /boot/vmlinuz-KVER"
assert_eq "busybox source" "$(json_get "$out/build.json" 'j["busybox"]')" "image:/bin/busybox"
gzip -dc "$out/initrd.img" | cpio -t --quiet >"$out/list" || fail "the initramfs is not a gzip cpio archive"
for f in init bin/busybox bin/vdstream etc/vdstream/udhcpc.script etc/vdstream/modules lib/modules/nbd.ko lib/modules/virtio_net.ko; do
    grep -qx "$f" "$out/list" || fail "$f is not in the initramfs"
done
while read -r lib; do
    grep -qx "${lib#/}" "$out/list" || fail "vdstream's library $lib is not in the initramfs"
done < <(ldd "$VDSTREAM_BIN" | grep -o '/[^ ]*')
order=$(json_get "$out/build.json" '" ".join(j["modules"])')
log "modules: $order"
json_get "$out/build.json" 'all(j["modules"].index(a) < j["modules"].index(b) for a, b in [("virtio", "virtio_pci"), ("virtio_ring", "virtio_net"), ("failover", "net_failover"), ("net_failover", "virtio_net"), ("scsi_mod", "sd_mod")])' |
    grep -qx True || fail "modules not in dependency order: $order"

# A version without a kernel: exit 3 and a message that says so.
mkdir -p "$E2E_TMP/empty/etc"
truncate -s 16M "$E2E_TMP/empty.img"
mkfs.ext4 -q -F -d "$E2E_TMP/empty" "$E2E_TMP/empty.img"
vds vdisk import bare "$E2E_TMP/empty.img" >/dev/null
rc=0
vds initrd build --vdisk bare --out "$out/bare.img" 2>"$out/bare.err" || rc=$?
assert_eq "exit status without a kernel" "$rc" 3
grep -q "vDisk bare version base has no kernel" "$out/bare.err" || { cat "$out/bare.err" >&2; fail "no clear message"; }
[[ ! -e $out/bare.img ]] || fail "a failed build left a file"
rc=0
vds initrd build --vdisk nosuch --out "$out/x.img" 2>/dev/null || rc=$?
assert_eq "exit status for an unknown vDisk" "$rc" 3
rc=0
vds initrd build --vdisk golden --module no_such_driver --out "$out/x.img" --json >"$out/mod.json" 2>/dev/null || rc=$?
assert_eq "exit status for a missing module" "$rc" 1
grep -q 'no_such_driver is neither' "$out/mod.json" || fail "the JSON error does not name the module"

# The initramfs in a VM: DHCP, then the agent started with the contract's arguments.
require qemu-system-x86_64
serial=$E2E_TMP/netboot.serial
timeout --kill-after=5 90 qemu-system-x86_64 -accel "$(vm_accel)" -m 512M -smp 1 -nographic -no-reboot \
    -monitor none -serial "file:$serial" -kernel "$out/vmlinuz" -initrd "$out/initrd.img" \
    -append "console=ttyS0 quiet panic=-1 vdstream.target=lab1 vdstream.server=http://10.0.2.2:9 vdstream.vdisk=golden@base vdstream.hostname=lab1 vdstream.on_fail=halt" \
    -netdev user,id=n0 -device virtio-net-pci,netdev=n0 >"$E2E_TMP/netboot.qemu.log" 2>&1 </dev/null &
qpid=$!
track_pid "$qpid"
want='vdstream-init: attaching: vdstream target attach lab1 --server http://10.0.2.2:9 --vdisk golden@base --cache ram-overflow --booting --kernel-nbd /dev/nbd0 --daemon'
for ((i = 0; i < 900; i++)); do
    grep -aqF "$want" "$serial" 2>/dev/null && break
    kill -0 "$qpid" 2>/dev/null || break
    sleep 0.1
done
kill "$qpid" 2>/dev/null || true
grep -aq '^vdstream-init: eth0: 10\.0\.2\.15/24' "$serial" || { tail -n 20 "$serial" >&2; fail "no DHCP lease in the guest"; }
grep -aqF "$want" "$serial" || { tail -n 20 "$serial" >&2; fail "/init did not start the agent as the contract says"; }
log "ok: the initramfs booted, got a lease and started the agent"
