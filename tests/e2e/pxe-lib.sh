# shellcheck shell=bash
# tests/e2e/pxe-lib.sh — diskless machines that boot from the network, for the
# test-pxe-*.sh tests (source after lib.sh, store-lib.sh, server-lib.sh and vm-lib.sh):
#
#   pxe_test_init NAME        require_vdstream, e2e_init, require_pxe, store_init, the golden
#                             image imported as vDisk NAME; keeps the logs of a failed run
#   require_pxe               qemu-system-x86_64, qemu's iPXE ROM (Debian: ipxe-qemu) and
#                             the golden image (vm-lib.sh: it carries /boot/vmlinuz-KVER and
#                             /lib/modules/KVER, so the boot service reads its kernel)
#   require_pxe_tools         the same without the golden image
#   stock_image               the stock-layout image (scripts/make-stock-image: Debian's
#                             generic kernel with its full module tree, ext4 with the default
#                             features); sets STOCK_IMG, STOCK_KVER, STOCK_MODULES
#   pxe_mac N                 the fixed MAC of machine N: 52:54:00:5e:NN:NN (hex of N)
#   free_port                 a TCP port nothing listens on (127.0.0.1)
#   start_boot_server [ARGS]  `vdstream server --store $STORE --listen 127.0.0.1:P --http
#                             127.0.0.1:Q --boot --boot-kernel-args "$PXE_KERNEL_ARGS"
#                             ARGS...`; waits for its API; sets SERVER_PID, SERVER_LOG,
#                             BOOT_API (http://127.0.0.1:Q), BOOT_NBD (127.0.0.1:P),
#                             BOOT_URL (the URL a target
#                             behind qemu's user-mode network uses: http://10.0.2.2:Q)
#   restart_boot_server       start the last boot server again on its ports (after a kill)
#   pxe_start NAME MAC [QEMU_ARGS...]
#                             a diskless machine (no disk unless QEMU_ARGS add one) whose
#                             firmware (qemu's iPXE ROM, -boot n) gets $BOOT_URL/boot/ipxe
#                             as its boot file from qemu's user-mode DHCP; serial console
#                             in $E2E_TMP/NAME.serial; sets VM_PID. Bounded by VM_SECS.
#   pxe_boot NAME MAC [QEMU_ARGS...]   pxe_start + wait_vm (the guest must end with DONE ok)
#   serial_count NAME REGEX   how many serial lines match REGEX
#
# The network-namespace lab (the real PXE path: a bridge, a site DHCP server, a proxy DHCP,
# TFTP, iPXE over HTTP):
#
#   lab_init                  namespaces $LAB (bridge br0 10.99.0.1/24, where the boot
#                             server and the proxy DHCP run) and $LAB-dhcp (the site's own
#                             DHCP server, 10.99.0.2, dnsmasq handing out 10.99.0.100-199 and
#                             nothing about booting), joined by a veth; deleted on exit
#   lab_exec CMD...           run CMD in $LAB
#   lab_tap NAME              a tap device NAME on br0 (for one qemu)
#   lab_proxy_dhcp HTTP_URL [--tftp-root DIR]
#                             dnsmasq in $LAB as proxy DHCP only (port=0: no DNS): a PXE ROM
#                             is sent to TFTP undionly.0 from 10.99.0.1, the iPXE it
#                             loads is sent to HTTP_URL; with --tftp-root, dnsmasq serves
#                             that TFTP itself (else something else must: vdstream --tftp)
#   lab_start NAME MAC TAP [QEMU_ARGS...]   a diskless machine on the tap (-boot n)
#
# Every machine gets -m $PXE_MEM (512M: the initramfs holds the vdstream binary, and the RAM
# write cache lives in the machine), one vCPU, a virtio-net NIC with a fixed MAC, its serial
# console in a file, -no-reboot (a kernel panic or a reboot ends qemu, so a test sees it).
# On a failed run the serial consoles and the logs are copied to
# target/test-logs/TEST-NAME/ (scripts/test keeps the test's own log beside it).

PXE_MEM=${VDSTREAM_PXE_MEM:-512M}
PXE_ROM_DIR=/usr/lib/ipxe/qemu
PXE_IPXE_DIR=/usr/lib/ipxe
# The golden image's console and clock arguments (vm-lib.sh says why), then the test mode.
PXE_KERNEL_ARGS=${PXE_KERNEL_ARGS:-"console=ttyS0 panic=-1 quiet no_timer_check tsc=unstable vdstest=boot"}
BOOT_API=
BOOT_NBD=
BOOT_URL=
BOOT_ARGS=()
LAB=

pxe_test_init() {
    require_vdstream
    e2e_init
    E2E_CLEANUP_HOOKS+=(pxe_keep_logs)
    require_pxe
    store_init
    vm_store "$1"
}

require_pxe() {
    require_pxe_tools
    golden_image
}

require_pxe_tools() {
    require qemu-system-x86_64 curl
    [[ -f $PXE_ROM_DIR/efi-virtio.rom || -f $PXE_ROM_DIR/pxe-virtio.rom ]] ||
        skip "qemu's iPXE ROM is not installed (Debian: apt-get install ipxe-qemu)"
}

# stock_image — the stock-layout image of scripts/make-stock-image (Debian's generic kernel
# package with its full module tree, ext4 with mkfs.ext4's default features), built once
# into its cache; sets STOCK_IMG, STOCK_KVER and STOCK_MODULES (its module tree, as installed).
stock_image() {
    require depmod mkfs.ext4 dumpe2fs
    if ! STOCK_IMG=$("$REPO_ROOT/scripts/make-stock-image" 2>"$E2E_TMP/stock-image.log" | tail -n1); then
        cat "$E2E_TMP/stock-image.log" >&2
        # No package lists or no network: a machine that cannot build it skips.
        if grep -q 'apt-get download\|apt-cache knows no' "$E2E_TMP/stock-image.log"; then
            skip "cannot build the stock-layout image: $(tail -n1 "$E2E_TMP/stock-image.log")"
        fi
        fail "scripts/make-stock-image failed"
    fi
    [[ -f $STOCK_IMG ]] || fail "scripts/make-stock-image named no image: $STOCK_IMG"
    STOCK_KVER=$(cat "$(dirname "$STOCK_IMG")/kver")
    STOCK_MODULES=$(dirname "$STOCK_IMG")/installed/usr/lib/modules/$STOCK_KVER
}

pxe_mac() { printf '52:54:00:5e:%02x:%02x' $(($1 >> 8)) $(($1 & 255)); }

free_port() {
    "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# pxe_keep_logs RC — on a failed run, keep the consoles and logs under target/test-logs.
pxe_keep_logs() {
    local rc=$1 dir=$REPO_ROOT/target/test-logs/$E2E_NAME
    [[ $rc -ne 0 && $rc -ne 77 && -n $E2E_TMP ]] || return 0
    rm -rf "$dir"
    mkdir -p "$dir"
    find "$E2E_TMP" -maxdepth 1 -type f \( -name '*.serial' -o -name '*.log' -o -name '*.json' \) \
        -exec cp {} "$dir/" \; 2>/dev/null
    echo "$E2E_NAME: the consoles and logs of this run are in ${dir#"$REPO_ROOT/"}" >&2
}

start_boot_server() {
    local nbd http
    nbd=$(free_port)
    http=$(free_port)
    BOOT_ARGS=(--listen "127.0.0.1:$nbd" --http "127.0.0.1:$http" --boot --boot-kernel-args "$PXE_KERNEL_ARGS" "$@")
    BOOT_API=http://127.0.0.1:$http
    BOOT_NBD=127.0.0.1:$nbd
    BOOT_URL=http://10.0.2.2:$http
    start_store_server "${BOOT_ARGS[@]}"
    wait_boot_api
}

restart_boot_server() {
    start_store_server "${BOOT_ARGS[@]}"
    wait_boot_api
}

wait_boot_api() {
    local i
    for ((i = 0; i < READY_SECS * 10; i++)); do
        curl -sf --max-time 2 "$BOOT_API/api/v1/server" >/dev/null && return 0
        sleep 0.1
    done
    fail "the boot server's API did not answer on $BOOT_API within ${READY_SECS}s"
}

# wait_serial NAME REGEX SECS — wait (bounded) until the console of NAME has a line matching
# REGEX; fails after SECS.
wait_serial() {
    local i
    for ((i = 0; i < $3 * 10; i++)); do
        serial_has "$1" "$2" && return 0
        sleep 0.1
    done
    tail -n 20 "$E2E_TMP/$1.serial" >&2 2>/dev/null
    fail "machine $1: no console line matching '$2' within $3 s"
}

# pxe_qemu_argv NAME MAC NETDEV [QEMU_ARGS...] — the qemu command line (NUL-separated).
pxe_qemu_argv() {
    local name=$1 mac=$2 netdev=$3
    shift 3
    printf '%s\0' qemu-system-x86_64 -accel "$(vm_accel)" -m "$PXE_MEM" -smp 1 -nographic -no-reboot \
        -monitor none -serial "file:$E2E_TMP/$name.serial" -boot n \
        -netdev "$netdev" -device "virtio-net-pci,netdev=n0,mac=$mac" "$@"
}

pxe_start() {
    local name=$1 mac=$2 argv=()
    shift 2
    vm_accel >/dev/null
    mapfile -d '' argv < <(pxe_qemu_argv "$name" "$mac" "user,id=n0,bootfile=$BOOT_URL/boot/ipxe" "$@")
    date +%s.%N >"$E2E_TMP/$name.started"
    timeout --kill-after=5 "$VM_SECS" "${argv[@]}" >"$E2E_TMP/$name.qemu.log" 2>&1 </dev/null &
    VM_PID=$!
    track_pid "$VM_PID"
    log "machine $name ($mac) network-booting from $BOOT_URL/boot/ipxe (pid $VM_PID)"
}

pxe_boot() {
    pxe_start "$@"
    wait_vm "$1" "$VM_PID"
}

serial_count() {
    local n
    n=$(grep -acE "$2" "$E2E_TMP/$1.serial" 2>/dev/null) || true
    echo "${n:-0}"
}

# ---------------------------------------------------------------- the namespace lab
lab_delete() {
    [[ -n $LAB ]] || return 0
    ip netns pids "$LAB" 2>/dev/null | xargs -r kill -KILL 2>/dev/null
    ip netns pids "$LAB-dhcp" 2>/dev/null | xargs -r kill -KILL 2>/dev/null
    ip netns del "$LAB" 2>/dev/null
    ip netns del "$LAB-dhcp" 2>/dev/null
    return 0
}

lab_exec() { ip netns exec "$LAB" "$@"; }

lab_init() {
    require ip dnsmasq
    [[ $(id -u) -eq 0 ]] || skip "network namespaces need root"
    LAB=vds-$$
    E2E_CLEANUP_HOOKS+=(lab_delete)
    ip netns add "$LAB" || skip "cannot make a network namespace (ip netns add)"
    ip netns add "$LAB-dhcp" || fail "ip netns add $LAB-dhcp"
    ip -n "$LAB" link set lo up
    ip -n "$LAB-dhcp" link set lo up
    ip -n "$LAB" link add br0 type bridge
    ip -n "$LAB" addr add 10.99.0.1/24 dev br0
    ip -n "$LAB" link set br0 up
    ip link add vethd netns "$LAB" type veth peer name eth0 netns "$LAB-dhcp" || fail "ip link add veth"
    ip -n "$LAB" link set vethd master br0 up
    ip -n "$LAB-dhcp" addr add 10.99.0.2/24 dev eth0
    ip -n "$LAB-dhcp" link set eth0 up
    # The site's DHCP server: addresses only (--no-ping: answer at once).
    ip netns exec "$LAB-dhcp" dnsmasq --keep-in-foreground --conf-file=/dev/null --port=0 \
        --interface=eth0 --bind-interfaces --no-ping --dhcp-range=10.99.0.100,10.99.0.199,255.255.255.0,10m \
        --dhcp-leasefile="$E2E_TMP/dhcp.leases" --log-dhcp --log-facility="$E2E_TMP/dhcp.log" \
        --pid-file= >"$E2E_TMP/dhcp.out" 2>&1 </dev/null &
    track_pid $!
    log "lab: namespaces $LAB (br0 10.99.0.1) and $LAB-dhcp (site DHCP 10.99.0.2)"
}

lab_tap() {
    ip -n "$LAB" tuntap add "$1" mode tap || fail "ip tuntap add $1"
    ip -n "$LAB" link set "$1" master br0 up
}

# The proxy DHCP as docs/BOOT.md gives it to administrators (pxe-service basename
# "undionly": a BIOS ROM asks for undionly.0, which vdstream's TFTP answers with
# undionly.kpxe), with one change for qemu: its ROM is iPXE already, so the usual "user
# class iPXE gets the HTTP URL" rule would skip TFTP. Its first DHCP request says
# "PXEClient:Arch:00000:UNDI:002001" (as a vendor's PXE ROM does), the undionly.kpxe it
# chainloads says "PXEClient" only: that tells the two stages apart. (dnsmasq finds the
# menu item of the later boot-server request, port 4011, by its number alone.)
lab_proxy_dhcp() {
    local url=$1 tftp=()
    if [[ ${2:-} == --tftp-root ]]; then tftp=(--enable-tftp --tftp-root="$3"); fi
    lab_exec dnsmasq --keep-in-foreground --conf-file=/dev/null --port=0 --interface=br0 --bind-interfaces \
        --dhcp-range=10.99.0.0,proxy --log-dhcp --log-facility="$E2E_TMP/proxy-dhcp.log" --pid-file= \
        --dhcp-vendorclass=set:pxerom,PXEClient:Arch \
        --pxe-prompt="vdstream network boot",0 \
        --pxe-service=tag:pxerom,x86PC,"iPXE (vdstream)",undionly,10.99.0.1 \
        --pxe-service=tag:!pxerom,x86PC,"vdstream",$url \
        "${tftp[@]}" >"$E2E_TMP/proxy-dhcp.out" 2>&1 </dev/null &
    track_pid $!
}

lab_start() {
    local name=$1 mac=$2 tap=$3 argv=()
    shift 3
    vm_accel >/dev/null
    mapfile -d '' argv < <(pxe_qemu_argv "$name" "$mac" "tap,id=n0,ifname=$tap,script=no,downscript=no" "$@")
    date +%s.%N >"$E2E_TMP/$name.started"
    lab_exec timeout --kill-after=5 "$VM_SECS" "${argv[@]}" >"$E2E_TMP/$name.qemu.log" 2>&1 </dev/null &
    VM_PID=$!
    track_pid "$VM_PID"
    log "machine $name ($mac) PXE-booting on $tap in $LAB (pid $VM_PID)"
}
