#!/usr/bin/env bash
# The golden-image guest boots through a server whose store is on a real 3-node Garage
# cluster: the store is copied up, `vdstream server --store s3://…` starts on an empty
# chunk cache, a target's agent (ram-overflow) attaches to it, and the guest (qemu, TCG)
# boots, writes a file, runs the workload (tar copy, small files with syncs, fstrim)
# through its own ext4, reboots and finds its file; the served disk passes `e2fsck -fn`.
# The server fetched chunks from Garage and none failed its checksum.
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
# shellcheck source=garage-lib.sh
source "$E2E_DIR/garage-lib.sh"
require nbdinfo qemu-img e2fsck
vm_test_init golden
garage_start
S3=s3://vdstream-test/farm
"$VDSTREAM_BIN" store copy --from "$STORE" --to "$S3" >/dev/null
LOCAL=$STORE
STORE=$S3
start_store_server --object-cache "$E2E_TMP/objcache" --object-cache-ram 64M --object-cache-disk 256M
STORE=$LOCAL

start_agent pc1 --server "$(xuri vdisk/golden)" --cache ram-overflow --ram 32M
boot_vm pc1 "$URI" "vdstest=write vdstest.tag=pc1 vdstest.mb=8"
boot_vm pc1-work "$URI" "vdstest=workload vdstest.rounds=1 vdstest.fstrim=1"
serial_has pc1-work '^VDSTEST WORKLOAD round=1 ' || fail "the workload did not finish"
serial_has pc1-work "^VDSTEST SEES pc1 ok" || fail "the workload boot lost the first boot's file"
fsck_served "$URI"
boot_vm pc1-again "$URI" "vdstest=check"
serial_has pc1-again "^VDSTEST SEES pc1 ok" || fail "the reboot lost the file"
log "ok: booted three times from the store on Garage; the served file system is clean"
sleep 2.5   # the chunk counters are written with each metadata refresh (2 s)
stats=$E2E_TMP/objcache/vdstream-test/farm/object-stats.json
gets=$(json_get "$stats" 'j["chunks"]["gets"]')
((gets > 0)) || fail "the server fetched no chunk from Garage"
assert_eq "chunks failing their checksum" "$(json_get "$stats" 'j["chunks"]["corrupt"]')" 0
log "the server made $gets GETs ($(json_get "$stats" 'j["chunks"]["get_bytes"] >> 20') MiB) for three boots"
stop_server "$AGENT_PID" 15 || fail "the agent did not stop cleanly"
echo "PASS"
