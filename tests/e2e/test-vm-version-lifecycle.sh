#!/usr/bin/env bash
# The version life cycle on real guests. A target (old1) boots the golden image's base and
# keeps running, writing and verifying a file with sync every half second. Meanwhile
# `version new` opens version 1 in maintenance, a maintenance guest boots it read-write
# through the server's maintenance/golden export and adds a file, and `version promote
# --to production` releases it. The next standard target (new1) boots version 1 and sees
# the file; old1 keeps working through the promote (its agent pinned the base), and a
# reboot of old1 on the same attach still gets the base, without the file.
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
require nbdinfo
vm_test_init golden
start_store_server

# old1: attached to production (the base) before the new version exists; runs 30 s.
start_agent old1 --server "$(xuri vdisk/golden)" --cache ram-overflow --ram 64M
uri_old1=$URI pid_old1=$AGENT_PID
start_vm old1 "$uri_old1" "vdstest=loop vdstest.secs=30"
vm_old1=$VM_PID
for _ in $(seq 600); do
    serial_has old1 '^VDSTEST ROUND 1 ok' && break
    kill -0 "$vm_old1" 2>/dev/null || break
    sleep 0.1
done
serial_has old1 '^VDSTEST ROUND 1 ok' || fail "old1 did not start its write loop: $(tail -n 5 "$E2E_TMP/old1.serial")"
log "ok: old1 is running on the base"

# A new version, patched by a maintenance boot.
v=$(vds version new golden --json | json_get /dev/stdin 'j["version"]["number"]')
boot_vm maint "$(xuri maintenance/golden)" "vdstest=write vdstest.tag=v$v-feature vdstest.mb=2"
serial_has maint "^VDSTEST WROTE v$v-feature" || fail "the maintenance boot did not write its file"
vds version promote golden "$v" --to production >/dev/null
rounds_at_promote=$(grep -ac '^VDSTEST ROUND [0-9]* ok' "$E2E_TMP/old1.serial")
log "ok: version $v made in maintenance and promoted (old1 at round $rounds_at_promote)"

# The next standard target boots the new version and sees the file.
start_agent new1 --server "$(xuri vdisk/golden)" --cache ram-overflow
boot_vm new1 "$URI" "vdstest=check"
serial_has new1 "^VDSTEST SEES v$v-feature ok" || fail "new1 did not see the maintenance boot's file"
desc=$(agent_status_get new1 'j["vdisk"]["description"]')
[[ $desc == "vdisk/golden@$v "* ]] || fail "new1 attached to $desc, not version $v"
log "ok: new1 booted version $v and sees its file"
stop_server "$AGENT_PID" 15 || fail "the new1 agent did not stop cleanly"

# old1 kept reading and writing through the promote, on the base.
wait_vm old1 "$vm_old1"
rounds=$(grep -ac '^VDSTEST ROUND [0-9]* ok' "$E2E_TMP/old1.serial")
((rounds > rounds_at_promote)) || fail "old1 wrote no round after the promote ($rounds rounds)"
desc=$(agent_status_get old1 'j["vdisk"]["description"]')
[[ $desc == "vdisk/golden@base "* ]] || fail "old1's agent moved to $desc"
log "ok: old1 ran $rounds verified write rounds, $((rounds - rounds_at_promote)) after the promote, on $desc"

# A reboot on the same attach stays on the pinned base.
boot_vm old1-reboot "$uri_old1" "vdstest=check"
! serial_has old1-reboot "^VDSTEST SEES v$v-feature" || fail "old1's reboot on its old attach sees version $v's file"
log "ok: old1's agent still serves the base after the promote"
stop_server "$pid_old1" 15 || fail "the old1 agent did not stop cleanly"
rc=0
stop_server "$SERVER_PID" 15 || rc=$?
assert_eq "server exit status" "$rc" 0
