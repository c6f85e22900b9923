#!/usr/bin/env bash
# Two servers of one store; a network-booted machine whose kernel command line names both
# (server a's --boot-server names b) runs the golden image's write-and-verify loop (1 MiB
# files, sync, drop caches, read back, compare) while server a, the one it booted from and
# reads through, is killed with SIGKILL. The loop goes on through server b to its end with
# every round verified, and the guest's kernel logged no I/O error.
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

mac=$(pxe_mac 4)
vds target add fo1 --vdisk golden --cache ram-overflow --ram 64M --mac "$mac" >/dev/null
PXE_KERNEL_ARGS="$PXE_KERNEL_ARGS vdstest=loop vdstest.secs=40"
# Server b first: a names it as the next server on the kernel command line.
start_boot_server --name b
pid_b=$SERVER_PID url_b=$BOOT_URL api_b=$BOOT_API
start_boot_server --name a --boot-server "$url_b"
pid_a=$SERVER_PID api_a=$BOOT_API

pxe_start fo1 "$mac"
vm=$VM_PID
for ((i = 0; i < VM_SECS * 10; i++)); do
    (($(serial_count fo1 '^VDSTEST ROUND [0-9]+ ok') >= 3)) && break
    kill -0 "$vm" 2>/dev/null || break
    sleep 0.1
done
(($(serial_count fo1 '^VDSTEST ROUND [0-9]+ ok') >= 3)) || { wait_vm fo1 "$vm"; fail "the loop did not start"; }
serial_has fo1 'vdstream-init: attaching: .*--server http://10\.0\.2\.2:[0-9]+ --server http://10\.0\.2\.2:[0-9]+ ' ||
    fail "the initramfs did not attach with both servers: $(grep -a 'vdstream-init: attaching' "$E2E_TMP/fo1.serial")"
# The serving one: the server with the machine's NBD session (the agent picks the less busy).
sessions() { curl -sS --max-time 5 "$1/api/v1/server" | json_get /dev/stdin 'j["sessions"]'; }
if (($(sessions "$api_a") >= 1)); then victim=a pid=$pid_a; else victim=b pid=$pid_b pid_b=$pid_a api_b=$api_a; fi
kill -KILL "$pid"
log "server $victim (serving the machine) killed with SIGKILL after $(serial_count fo1 '^VDSTEST ROUND [0-9]+ ok') verified rounds"
wait_vm fo1 "$vm"
rounds=$(serial_count fo1 '^VDSTEST ROUND [0-9]+ ok')
serial_has fo1 '^VDSTEST FAIL' && fail "a round failed after the kill: $(grep -a '^VDSTEST FAIL' "$E2E_TMP/fo1.serial")"
serial_has fo1 '^VDSTEST KERNEL-IO-ERRORS n=0' || fail "the guest's kernel logged I/O errors: $(grep -a 'KERNEL-IO' "$E2E_TMP/fo1.serial")"
serial_has fo1 'I/O error|EXT4-fs error|nbd.*(timed out|error)' && fail "the console shows kernel errors: $(grep -aE 'I/O error|EXT4-fs error|nbd' "$E2E_TMP/fo1.serial" | head -n 5)"
log "ok: $rounds rounds verified, the last ones through the other server; no I/O error in the guest"
curl -sS --max-time 10 "$api_b/api/v1/server" >"$E2E_TMP/b.json" || fail "GET /api/v1/server of the other server failed"
rc=0
stop_server "$pid_b" 15 || rc=$?
assert_eq "the other server's exit status" "$rc" 0
