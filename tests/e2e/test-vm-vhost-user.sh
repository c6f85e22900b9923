#!/usr/bin/env bash
# The agent serves the target's disk as a vhost-user-blk backend (`target attach
# --vhost-user SOCK --vhost-queues 2`, with --socket for the NBD side as well) and qemu
# boots the golden image from it (vhost-user-blk-pci, 2 queues, 2 vCPUs, guest RAM a
# shared memfd):
#  - the fsck workload of test-vm-workload-fsck (a write boot, then the tar/small-files
#    workload with fstrim, so DISCARD reaches the ram-overflow cache) runs on a
#    `ram-overflow --ram 16M` target; the disk the agent serves over NBD passes e2fsck, and
#    a third qemu on the same socket (every boot is a new frontend connecting) sees the
#    file of the first; the agent's status counts the guest's writes (> 40 MiB) as on the
#    NBD path, and none reached the server;
#  - with two servers on one store, the one in use is killed with SIGKILL while a fresh
#    guest reads the vDisk (the workload's tar reads the base): the guest finishes with no
#    I/O error, and the agent reports a failover (or reconnect).
# The agent has no read-only attach, so there is no read-only case.
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
qemu-system-x86_64 -device help 2>/dev/null | grep -q '"vhost-user-blk-pci"' ||
    skip "this qemu-system-x86_64 has no vhost-user-blk-pci device"
"$VDSTREAM_BIN" target attach --help | grep -q -- --vhost-user ||
    fail "$VDSTREAM_BIN target attach has no --vhost-user"

QUEUES=2
start_store_server --name a
pid_a=$SERVER_PID sock_a=$SOCK
start_store_server --name b
sock_b=$SOCK

# start_vhost_agent ID ARGS... — an agent serving ID over vhost-user on $VHOST (RUN/ID.vhost)
# and over NBD on RUN/ID.sock (start_agent waits for that one); waits for the vhost socket.
VHOST=
start_vhost_agent() {
    local id=$1 i
    shift
    agent_env
    VHOST=$VDSTREAM_RUN_DIR/$id.vhost
    start_agent "$id" --vhost-user "$VHOST" --vhost-queues "$QUEUES" \
        --socket "$VDSTREAM_RUN_DIR/$id.sock" "$@"
    for ((i = 0; i < 100; i++)); do
        [[ -S $VHOST ]] && return 0
        sleep 0.1
    done
    fail "the agent of $id serves NBD but no vhost-user socket $VHOST after 10 s"
}

# no_io_errors NAME — the guest saw no I/O error (its dmesg count, and its console).
no_io_errors() {
    serial_has "$1" '^VDSTEST KERNEL-IO-ERRORS n=0' ||
        fail "guest $1 saw I/O errors: $(grep -a 'KERNEL-IO-ERRORS' "$E2E_TMP/$1.serial")"
    ! serial_has "$1" 'I/O error|blk_update_request|Buffer I/O|EXT4-fs error' ||
        fail "guest $1 logged I/O errors: $(grep -aE 'I/O error|blk_update_request|Buffer I/O|EXT4-fs error' "$E2E_TMP/$1.serial" | head -n5)"
}

# 1. The fsck workload over vhost-user-blk, three frontends one after the other.
id=vu1
start_vhost_agent "$id" --server "$(xuri vdisk/golden "$sock_a")" --cache ram-overflow --ram 16M
boot_vm_vhost "$id" "$VHOST" "vdstest=write vdstest.tag=$id vdstest.mb=8" "$QUEUES"
serial_has "$id" '^VDSTEST HOST .* root=/dev/vda' || fail "the guest's root is not /dev/vda"
serial_has "$id" '^VDSTEST RW ok' || fail "the guest's root was not writable"
serial_has "$id" "^VDSTEST WROTE $id mb=8" || fail "the guest did not write its file"
log "ok: booted from vhost-user-blk in $(vm_secs "$id") s"
boot_vm_vhost "$id-work" "$VHOST" "vdstest=workload vdstest.rounds=2 vdstest.fstrim=1" "$QUEUES"
serial_has "$id-work" '^VDSTEST WORKLOAD round=2 ' || fail "the workload did not finish its rounds"
serial_has "$id-work" '^VDSTEST FSTRIM /: [0-9]+ bytes trimmed' || fail "fstrim did not run"
serial_has "$id-work" "^VDSTEST SEES $id ok" || fail "the workload boot lost the first boot's file"
no_io_errors "$id-work"
log "ok: workload in $(vm_secs "$id-work") s: $(grep -a '^VDSTEST FSTRIM' "$E2E_TMP/$id-work.serial" | tr -d '\r')"
sleep 1.5 # the agent rewrites its status file every second
"$VDSTREAM_BIN" target status "$id" --json >"$E2E_TMP/$id.json" || fail "target status $id failed"
"$PY" - "$E2E_TMP/$id.json" "$id" "$VHOST" "$QUEUES" <<'PYEOF' || fail "$id status: $(cat "$E2E_TMP/$id.json")"
import json, sys
j = json.load(open(sys.argv[1]))
g, s, c, v = j["guest"], j["storage"], j["cache"], j["vhost_user"]
assert v["socket"] == sys.argv[3] and v["queues"] == int(sys.argv[4]), v
assert v["connections"] == 2 and not v["connected"], ("two frontends came and went", v)
assert v["requests"] > 0 and v["errors"] == 0 and v["malformed"] == 0, v
assert g["write_bytes"] > 40 << 20, ("the guest's writes over vhost-user are not counted", g)
assert g["read_bytes"] > 0, g
assert j["server"]["write_bytes"] == 0, ("a guest write reached the server", j["server"])
assert c["type"] == "ram-overflow", c
assert c["evictions"] > 0 or c["file_bytes"] > 0, ("16 MiB of RAM never overflowed", c)
print(f"{sys.argv[2]}: vhost-user {v['requests']} requests over {v['connections']} frontends; guest read {g['read_bytes'] >> 20} MiB, wrote {g['write_ops']} ops / "
      f"{g['write_bytes'] >> 20} MiB; storage {s['write_ops']} ops / {s['write_bytes'] >> 20} MiB; cache {c}")
PYEOF
fsck_served "$URI"
log "ok: the file system the agent serves (read over its NBD socket) is clean after the workload"
boot_vm_vhost "$id-again" "$VHOST" "vdstest=check" "$QUEUES"
serial_has "$id-again" "^VDSTEST SEES $id ok" || fail "the third boot lost the file"
log "ok: a third frontend on the same socket sees the file"
stop_server "$AGENT_PID" 15 || fail "the $id agent did not stop cleanly"
[[ ! -e $VHOST ]] || fail "the agent left its vhost-user socket $VHOST behind"

# 2. SIGKILL of the server in use while a fresh guest reads the vDisk through vhost-user.
id=vu2
start_vhost_agent "$id" --server "$(xuri vdisk/golden "$sock_a")" --server "$(xuri vdisk/golden "$sock_b")" \
    --cache ram-overflow --ram 16M
start_vm_vhost "$id" "$VHOST" "vdstest=workload vdstest.rounds=2" "$QUEUES"
vm_pid=$VM_PID
# Kill once the guest's init runs (the kernel and initramfs came from the host; the root
# file system and the workload's tar come through the agent from the server).
for ((i = 0; i < 600; i++)); do
    serial_has "$id" 'VDSTEST BOOTED' && break
    kill -0 "$vm_pid" 2>/dev/null || break
    sleep 0.1
done
serial_has "$id" 'VDSTEST BOOTED' || { wait_vm "$id" "$vm_pid" 1; fail "guest $id did not reach its init"; }
sleep 0.5
before=$(agent_status_get "$id" 'j["server"]["read_bytes"]')
log "SIGKILL to the server in use (pid $pid_a), $((before >> 20)) MiB read from it so far"
kill -KILL "$pid_a"
wait_vm "$id" "$vm_pid"
serial_has "$id" '^VDSTEST WORKLOAD round=2 ' || fail "the workload did not finish its rounds across the kill"
no_io_errors "$id"
server_alive "$AGENT_PID" || fail "the agent died"
sleep 1.5
after=$(agent_status_get "$id" 'j["server"]["read_bytes"]')
failovers=$(agent_status_get "$id" 'j["server"]["failovers"]')
reconnects=$(agent_status_get "$id" 'j["server"]["reconnects"]')
log "agent: $failovers failovers, $reconnects reconnects; $(((after - before) >> 20)) MiB read from the server after the kill"
((failovers + reconnects > 0)) || fail "the agent reports no failover and no reconnect after its server was killed"
assert_eq "server in use after the kill" "$(agent_status_get "$id" 'j["server"]["endpoint"]')" "$(xuri vdisk/golden "$sock_b")"
assert_eq "connected" "$(agent_status_get "$id" 'j["server"]["connected"]')" True
assert_eq "vhost-user requests failed" "$(agent_status_get "$id" 'j["vhost_user"]["errors"]')" 0
fsck_served "$URI"
log "ok: the served file system is clean after the failover"
stop_server "$AGENT_PID" 15 || fail "the $id agent did not stop cleanly"
rc=0
stop_server "$SERVER_PID" 15 || rc=$?
assert_eq "exit status of the surviving server" "$rc" 0
