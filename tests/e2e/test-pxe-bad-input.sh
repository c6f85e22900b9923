#!/usr/bin/env bash
# What a network-booting machine sees when something is wrong, and what the server logs:
#   - an unknown MAC: the console says no record has it and how to add one; the server's
#     log names the MAC;
#   - a target whose vDisk has no kernel (an ext4 without /boot): the console says so (the
#     script's fallback fetches the reason), and the server's log names the vDisk;
#   - the server down while the initramfs attaches: /init and the agent print what they wait
#     for and retry; when the server is back on its ports, the machine boots to its init;
#   - garbled boot-file requests (a version that does not exist, not a number, another file
#     name, a bad MAC) get a clear HTTP error, never a file.
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
require mkfs.ext4
pxe_test_init golden

truncate -s 64M "$E2E_TMP/nokernel.img"
mkfs.ext4 -q -F "$E2E_TMP/nokernel.img"
vds vdisk import nokernel "$E2E_TMP/nokernel.img" >/dev/null
rm -f "$E2E_TMP/nokernel.img"
stranger=$(pxe_mac 0x0f0f) nk=$(pxe_mac 5) ok=$(pxe_mac 6)
vds target add nk1 --vdisk nokernel --cache ram-overflow --ram 32M --mac "$nk" >/dev/null
vds target add late1 --vdisk golden --cache ram-overflow --ram 32M --mac "$ok" >/dev/null
start_boot_server

# ---- garbled requests (no machine needed)
http() { # http PATH WANT-STATUS WANT-TEXT
    local got body
    got=$(curl -sS --max-time 10 -o "$E2E_TMP/body" -w '%{http_code}' "$BOOT_API$1") || fail "GET $1 failed"
    body=$(head -c 300 "$E2E_TMP/body")
    [[ $got == "$2" ]] || fail "GET $1: status $got, want $2 ($body)"
    grep -qiE "$3" "$E2E_TMP/body" || fail "GET $1: the answer does not say '$3': $body"
    log "ok: GET $1: $got $(head -n1 "$E2E_TMP/body")"
}
http /boot/vdisk/golden/99/initrd.img 404 '99'
http /boot/vdisk/golden/x1/initrd.img 400 'not a version'
http /boot/vdisk/golden/base/initrd.bak 404 'vmlinuz and initrd.img'
http /boot/vdisk/nosuch/base/vmlinuz 404 'nosuch'
http /boot/vdisk/nokernel/base/vmlinuz 404 'kernel'
http /boot/target/not-a-mac 400 'mac'
# ... and a good one, whole and by Range: the version's own kernel, byte for byte.
curl -sS --max-time 60 -D "$E2E_TMP/head" -o "$E2E_TMP/vmlinuz" "$BOOT_API/boot/vdisk/golden/base/vmlinuz" || fail "GET vmlinuz failed"
cmp -s "$E2E_TMP/vmlinuz" "$GOLDEN/vmlinuz" || fail "the served kernel is not the golden image's /boot/vmlinuz"
grep -qi "^content-length: $(stat -c %s "$GOLDEN/vmlinuz")" "$E2E_TMP/head" || fail "no right Content-Length: $(cat "$E2E_TMP/head")"
got=$(curl -sS --max-time 10 -r 1000-1999 -o "$E2E_TMP/part" -w '%{http_code}' "$BOOT_API/boot/vdisk/golden/base/vmlinuz")
assert_eq "a Range request's status" "$got" 206
cmp -s "$E2E_TMP/part" <(tail -c +1001 "$GOLDEN/vmlinuz" | head -c 1000) || fail "the Range request got other bytes"
log "ok: the kernel is served whole (Content-Length) and by Range"
grep -aq 'asked for vmlinuz of nokernel@base' "$SERVER_LOG" || fail "the server's log does not name the vDisk without a kernel"

# ---- an unknown machine and a target without a kernel, at the same time
pxe_start stranger "$stranger"
pid_s=$VM_PID
pxe_start nokernel "$nk"
pid_n=$VM_PID
wait_serial stranger "no target record has MAC $stranger" 120
wait_serial stranger "vdstream target add ID --mac $stranger" 10
grep -aq "refused MAC $stranger" "$SERVER_LOG" || fail "the server's log does not name the refused MAC $stranger"
log "ok: the unknown machine was told how to add it, and the log names its MAC"
wait_serial nokernel 'vdstream: vDisk nokernel version base has no kernel' 120
log "ok: the console says: $(grep -aE 'vdstream: vDisk nokernel version base has no kernel' "$E2E_TMP/nokernel.serial" | tail -n1 | tr -d '\r')"
stop_pid "$pid_s" 5
stop_pid "$pid_n" 5

# ---- the server down while the initramfs attaches
pxe_start late1 "$ok"
pid_l=$VM_PID
wait_serial late1 'vdstream-init: ' 120
kill -KILL "$SERVER_PID"
log "server killed while late1's initramfs starts"
wait_serial late1 '(waiting|retry|cannot reach|unreachable|refused).*(10\.0\.2\.2|server)' 90
log "ok: the console says what it waits for: $(grep -aiE '(waiting|retry|cannot reach|unreachable|refused).*(10\.0\.2\.2|server)' "$E2E_TMP/late1.serial" | tail -n1 | tr -d '\r')"
sleep 3
restart_boot_server
wait_vm late1 "$pid_l"
log "ok: late1 booted once the server was back"
rc=0
stop_server "$SERVER_PID" 15 || rc=$?
assert_eq "server exit status" "$rc" 0
