#!/usr/bin/env bash
# --overflow-device: ram-overflow's overflow on a raw block device (a loop device over a
# file of old bytes standing in for a target's scratch partition). fio with verification
# through the agent spills past 1 MiB of RAM onto it; the old bytes never show through;
# the base stays unchanged; past the device's size writes to new blocks get ENOSPC; a
# device already held by another agent is refused; device-ram refuses the flag.
# Needs root (losetup); skipped elsewhere.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
# shellcheck source=fio-verify.sh
source "$E2E_DIR/fio-verify.sh"
require fio qemu-io cmp losetup
require_vdstream
e2e_init

head -c $((16 << 20)) /dev/zero | tr '\0' '\356' >"$E2E_TMP/scratch.img"
loopdev=$(losetup --find --show "$E2E_TMP/scratch.img" 2>/dev/null) || skip "no loop device (needs root)"
# Stop what the test started, detach the loop device, then the usual cleanup (same status).
cleanup_loop() {
    local rc=$? i
    for ((i = ${#E2E_PIDS[@]} - 1; i >= 0; i--)); do
        stop_pid "${E2E_PIDS[i]}" 5
    done
    losetup -d "$loopdev" 2>/dev/null
    (exit "$rc")
    e2e_cleanup
}
trap cleanup_loop EXIT
base=$E2E_TMP/base.img
head -c $((48 << 20)) /dev/urandom >"$base"
cp "$base" "$E2E_TMP/base.pristine"
start_server "$base" --read-only
srv_uri=$URI

start_agent dev1 --server "$srv_uri" --cache ram-overflow --ram 1M --overflow-device "$loopdev"
run_fio_verify overflow-device --rw=randrw --rwmixwrite=60 --bsrange=4k-64k --size=8m --iodepth=16 --offset=4m
used=0
for ((i = 0; i < 50 && used <= 1 << 20; i++)); do
    sleep 0.1
    used=$(agent_status_get dev1 'j["cache"]["file_bytes"]')
done
((used > 1 << 20)) || fail "nothing spilled to the device (file_bytes $used)"
assert_eq "the device's size is the cap" "$(agent_status_get dev1 'j["cache"]["file_limit"]')" $((16 << 20))
# Untouched blocks read the vDisk, never the device's old 0xEE bytes.
qemu-io -f raw -c "read -v 40000000 16" "$URI" | grep -q "ee ee ee ee" && fail "the device's old bytes show through"

# A second agent on the same device is refused: the device is held exclusively.
rc=0
run_bounded 30 "$VDSTREAM_BIN" target attach dev2 --server "$srv_uri" --cache ram-overflow --overflow-device "$loopdev" >"$E2E_TMP/dev2.out" 2>&1 </dev/null || rc=$?
((rc != 0)) || fail "a second agent took the same overflow device"
grep -q "in use" "$E2E_TMP/dev2.out" || fail "the refusal does not say the device is in use: $(cat "$E2E_TMP/dev2.out")"

# Past the device (16 MiB = 8 units) and the 1 MiB of RAM, writes to new 2 MiB regions
# get ENOSPC.
nospace=0
for ((mib = 14; mib < 48; mib += 2)); do
    run_bounded 60 qemu-io -f raw -c "write -P 0x33 $((mib << 20)) 2M" "$URI" >"$E2E_TMP/w.out" 2>&1 || true
    if grep -q "No space left" "$E2E_TMP/w.out"; then nospace=1; break; fi
done
((nospace)) || fail "no ENOSPC past the overflow device's end"
stop_server "$AGENT_PID" || fail "the agent did not stop cleanly"
cmp -s "$base" "$E2E_TMP/base.pristine" || fail "the base image was written"

# device-ram keeps everything in RAM: the flag is refused, naming what takes it.
rc=0
run_bounded 30 "$VDSTREAM_BIN" target attach dev3 --server "$srv_uri" --cache device-ram --overflow-device "$loopdev" >"$E2E_TMP/dev3.out" 2>&1 </dev/null || rc=$?
assert_eq "device-ram with --overflow-device: exit status" "$rc" 2
grep -q "ram-overflow" "$E2E_TMP/dev3.out" || fail "the refusal does not say which types take it"
log "PASS"
