#!/usr/bin/env bash
# The real PXE path, in network namespaces this test makes (root): a bridge (the lab's
# switch) with the site's own DHCP server (dnsmasq in a second namespace, addresses only),
# a dnsmasq proxy DHCP beside it (the lines docs/BOOT.md gives administrators), and
# `vdstream server --boot --tftp` on the bridge's address. A diskless qemu machine on a tap:
# its PXE ROM gets an address from the site DHCP and the boot file from the proxy, loads
# Debian's undionly.kpxe over vdstream's TFTP, that iPXE gets the HTTP URL of
# /boot/ipxe from the proxy, chains to its script by MAC, loads kernel and initramfs over
# HTTP, and the machine boots the golden image to its test init with its vDisk on
# /dev/nbd0 over the bridge.
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
[[ -f $PXE_IPXE_DIR/undionly.kpxe ]] || skip "Debian's iPXE binaries are not installed (apt-get install ipxe)"
lab_init
lab_tap tap1
mac=$(pxe_mac 7)
vds target add lab-pc-07 --vdisk golden --cache ram-overflow --ram 64M --mac "$mac" >/dev/null

# The server runs in the lab namespace (its unix socket, used to wait for it, is reachable
# from here: a file, not a network address).
real_bin=$VDSTREAM_BIN
VDSTREAM_BIN=$E2E_TMP/vdstream-in-lab
printf '#!/bin/sh\nexec ip netns exec %s %s "$@"\n' "$LAB" "$real_bin" >"$VDSTREAM_BIN"
chmod +x "$VDSTREAM_BIN"
start_store_server --listen 10.99.0.1:10809 --http 10.99.0.1:8480 --insecure --boot \
    --boot-kernel-args "$PXE_KERNEL_ARGS vdstest=write vdstest.mb=1" --tftp 10.99.0.1:69
VDSTREAM_BIN=$real_bin
lab_proxy_dhcp http://10.99.0.1:8480/boot/ipxe

lab_start lab-pc-07 "$mac" tap1
wait_vm lab-pc-07 "$VM_PID"
log "lab-pc-07 PXE-booted in $(vm_secs lab-pc-07) s (qemu start to power-off)"
s=$E2E_TMP/lab-pc-07.serial
grep -aEq 'tftp://10\.99\.0\.1/undionly\.(0|kpxe)\.\.\. ok' "$s" || fail "the PXE ROM did not load undionly.kpxe over TFTP"
grep -aq 'using undionly on' "$s" || fail "the chainloaded iPXE did not start"
grep -aq 'http://10.99.0.1:8480/boot/ipxe... ok' "$s" || fail "iPXE did not fetch the boot script over HTTP"
grep -aq 'DHCPACK(eth0) 10.99.0.1[0-9][0-9] '"$mac" "$E2E_TMP/dhcp.log" || fail "the site DHCP server gave no lease to $mac"
grep -aEq "PXE\(br0\) 10\.99\.0\.1[0-9][0-9] $mac undionly\.(0|kpxe)" "$E2E_TMP/proxy-dhcp.log" || fail "the proxy DHCP did not send the PXE ROM to undionly.kpxe"
grep -aq "PXE(br0) 10.99.0.1[0-9][0-9] $mac http://10.99.0.1:8480/boot/ipxe" "$E2E_TMP/proxy-dhcp.log" || fail "the proxy DHCP did not send iPXE to /boot/ipxe"
grep -aq '^VDSTEST HOST name=lab-pc-07 .*root=/dev/nbd0' "$s" || fail "the machine did not come up as lab-pc-07 on /dev/nbd0: $(grep -a 'VDSTEST HOST' "$s")"
serial_has lab-pc-07 '^VDSTEST WROTE boot mb=1' || fail "the machine did not write"
log "ok: DHCP lease from the site server, proxy DHCP, TFTP of undionly.kpxe from vdstream, iPXE over HTTP, root on /dev/nbd0"
rc=0
stop_server "$SERVER_PID" 15 || rc=$?
assert_eq "server exit status" "$rc" 0
