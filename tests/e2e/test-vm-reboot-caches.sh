#!/usr/bin/env bash
# Reboot semantics on a real guest. Each target boots twice, detaching its agent between
# the boots as a machine's reboot does: the first boot writes a file (4 MiB, with its
# sha256, sync), the second reports what it finds. With a standard cache (`ram-overflow`)
# the second boot sees none of the first boot's files: the machine starts from the golden
# image. With `device-disk-persistent` (the agent's cache file, kept across attaches) and
# `server-persistent` (the server's cache of target/ID) it sees them, intact.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=server-lib.sh
source "$E2E_DIR/server-lib.sh"
# shellcheck source=agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
# shellcheck source=vm-lib.sh
source "$E2E_DIR/vm-lib.sh"
require nbdinfo qemu-img
vm_test_init golden
vds target add std1 --vdisk golden --cache ram-overflow >/dev/null
vds target add dp1 --vdisk golden --cache device-disk-persistent >/dev/null
vds target add sp1 --vdisk golden --cache server-persistent >/dev/null
start_store_server

# two_boots ID EXPORT CACHE — boot, write, detach; attach again, boot, check.
two_boots() {
    local id=$1 export=$2 cache=$3
    start_agent "$id" --server "$(xuri "$export")" --cache "$cache"
    boot_vm "$id-1" "$URI" "vdstest=write vdstest.tag=$id-first"
    serial_has "$id-1" "^VDSTEST WROTE $id-first" || fail "$id: the first boot did not write"
    stop_server "$AGENT_PID" 15 || fail "$id: the agent did not stop cleanly"
    start_agent "$id" --server "$(xuri "$export")" --cache "$cache"
    boot_vm "$id-2" "$URI" "vdstest=check"
    stop_server "$AGENT_PID" 15 || fail "$id: the second agent did not stop cleanly"
}

two_boots std1 vdisk/golden ram-overflow
! serial_has std1-2 '^VDSTEST SEES' || fail "ram-overflow: the reboot kept files: $(grep -a SEES "$E2E_TMP/std1-2.serial")"
log "ok: ram-overflow: the second boot started from the golden image"

two_boots dp1 vdisk/golden device-disk-persistent
serial_has dp1-2 '^VDSTEST SEES dp1-first ok' || fail "device-disk-persistent: the second boot did not see the first boot's file"
log "ok: device-disk-persistent: the second boot sees the first boot's file, intact"

two_boots sp1 target/sp1 server-persistent
serial_has sp1-2 '^VDSTEST SEES sp1-first ok' || fail "server-persistent: the second boot did not see the first boot's file"
log "ok: server-persistent: the second boot sees the first boot's file, intact"

# The persistent targets' writes stayed theirs: the vDisk still serves the golden image.
qemu-img compare -q -f raw -F raw "$GOLDEN/golden.img" "$(xuri vdisk/golden)" ||
    fail "the vDisk no longer serves the golden image's bytes"
log "ok: the golden image holds none of the targets' files"
rc=0
stop_server "$SERVER_PID" 15 || rc=$?
assert_eq "server exit status" "$rc" 0
