#!/usr/bin/env bash
# The guest workload (vdstest=workload: a tar copy of /usr/lib/modules, 200 small files
# with periodic syncs, a log, removal, sync, then fstrim) runs through the guest's own ext4
# and journal on a `ram-overflow --ram 16M` target, whose cache overflows to its file.
# After the guest powers off, the disk its agent serves passes `e2fsck -fn`, and the next
# boot on the same attach finds the file system as it left it. Reports guest writes
# against storage writes (bench/boot-storm.sh compares them across cache types).
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
require nbdinfo qemu-img e2fsck
vm_test_init golden
start_store_server

for spec in "ram16 ram-overflow --ram 16M"; do
    read -r id cache extra <<<"$spec"
    # shellcheck disable=SC2086 # extra is a list of flags
    start_agent "$id" --server "$(xuri vdisk/golden)" --cache "$cache" $extra
    boot_vm "$id" "$URI" "vdstest=write vdstest.tag=$id vdstest.mb=8"
    boot_vm "$id-work" "$URI" "vdstest=workload vdstest.rounds=2 vdstest.fstrim=1"
    serial_has "$id-work" '^VDSTEST WORKLOAD round=2 ' || fail "$id: the workload did not finish its rounds"
    serial_has "$id-work" '^VDSTEST FSTRIM /: [0-9]+ bytes trimmed' || fail "$id: fstrim did not run"
    serial_has "$id-work" "^VDSTEST SEES $id ok" || fail "$id: the workload boot lost the first boot's file"
    sleep 1.5 # the agent rewrites its status file every second
    "$VDSTREAM_BIN" target status "$id" --json >"$E2E_TMP/$id.json" || fail "target status $id failed"
    "$PY" - "$E2E_TMP/$id.json" "$id" <<'PYEOF' || fail "$id status: $(cat "$E2E_TMP/$id.json")"
import json, sys
j = json.load(open(sys.argv[1]))
g, s, c = j["guest"], j["storage"], j["cache"]
assert g["write_bytes"] > 40 << 20, g
assert j["server"]["write_bytes"] == 0, j["server"]
if c["type"] == "ram-overflow":
    assert c["evictions"] > 0 or c["file_bytes"] > 0, ("16 MiB of RAM never overflowed", c)
print(f"{sys.argv[2]}: guest wrote {g['write_ops']} ops / {g['write_bytes'] >> 20} MiB, storage "
      f"{s['write_ops']} ops / {s['write_bytes'] >> 20} MiB; cache {c}")
PYEOF
    fsck_served "$URI"
    log "ok: $id: the served file system is clean after the workload"
    boot_vm "$id-again" "$URI" "vdstest=check"
    serial_has "$id-again" "^VDSTEST SEES $id ok" || fail "$id: the next boot lost the file"
    stop_server "$AGENT_PID" 15 || fail "the $id agent did not stop cleanly"
done
rc=0
stop_server "$SERVER_PID" 15 || rc=$?
assert_eq "server exit status" "$rc" 0
