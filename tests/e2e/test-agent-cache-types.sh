#!/usr/bin/env bash
# Every cache type through the agent. The device types keep writes in the agent (the
# server serves the base read-only); `server` and `server-persistent` send them on to a
# serve-image with that cache (the agent passes through). For each: fio randrw with crc32c
# verify, then qemu-io writes a pattern at an unaligned offset and reads it back, and
# `target status` shows the type and the guest's writes. Afterwards the base file is
# byte-for-byte unchanged. A second attach of a non-persistent type starts clean (reads
# the base again, not the last attach's writes); device-disk-persistent keeps them.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
# shellcheck source=fio-verify.sh
source "$E2E_DIR/fio-verify.sh"
require fio qemu-io cmp nbdinfo
require_vdstream
e2e_init

base=$E2E_TMP/base.img
head -c $((48 << 20)) /dev/urandom >"$base"
cp "$base" "$E2E_TMP/base.pristine"

# qemu_io URI CMD — one qemu-io command on the raw NBD export.
qemu_io() { run_bounded 60 qemu-io -f raw -c "$2" "$1"; }

for type in ram-overflow device-ram device-disk device-disk-persistent server server-persistent; do
    log "==== cache type $type ===="
    case $type in
    server*) start_server "$base" --cache "$type" --overflow-dir "$E2E_TMP" --name "srv-$type" ;;
    *) start_server "$base" --read-only ;;
    esac
    srv_pid=$SERVER_PID
    srv_uri=$URI
    extra=()
    [[ $type == ram-overflow ]] && extra=(--ram 4M)
    [[ $type == device-ram ]] && extra=(--ram 64M)
    id=t-$type
    start_agent "$id" --server "$srv_uri" --cache "$type" "${extra[@]}"
    run_fio_verify "$type" --rw=randrw --rwmixwrite=60 --bsrange=4k-64k --size=16m --iodepth=16 --offset=4m
    qemu_io "$URI" "write -P 0x5a 40000001 7000" >/dev/null || fail "$type: qemu-io write"
    qemu_io "$URI" "read -P 0x5a 40000001 7000" | grep -q "read 7000/7000" || fail "$type: qemu-io read back"
    sleep 1.2
    assert_eq "$type: status cache type" "$(agent_status_get "$id" 'j["cache"]["type"]')" "$type"
    writes=$(agent_status_get "$id" 'j["guest"]["write_ops"]')
    ((writes > 0)) || fail "$type: status shows no guest writes"
    rc=0
    stop_server "$AGENT_PID" 15 || rc=$?
    assert_eq "$type: agent exit status" "$rc" 0
    grep -q "$type cache: guest" "$AGENT_LOG" || fail "$type: no cache summary at exit"
    if [[ $type == device-* || $type == ram-overflow ]]; then
        # Attach again: a non-persistent cache starts clean, the persistent one keeps the write.
        start_agent "$id" --server "$srv_uri" --cache "$type" "${extra[@]}"
        if [[ $type == device-disk-persistent ]]; then
            qemu_io "$URI" "read -P 0x5a 40000001 7000" | grep -q "read 7000/7000" ||
                fail "$type: the write did not survive a detach and attach"
            log "ok: $type keeps its writes across attaches"
        else
            # qemu-io exits 1 when the pattern differs: that is the expected outcome here.
            out=$(qemu_io "$URI" "read -P 0x5a 40000001 7000" 2>&1 || true)
            grep -q "Pattern verification failed" <<<"$out" ||
                fail "$type: a new attach still shows the last attach's writes"
            log "ok: $type starts clean on a new attach"
        fi
        stop_server "$AGENT_PID" 15 || fail "$type: second agent did not stop cleanly"
    fi
    stop_server "$srv_pid" 15 || true
    cmp "$base" "$E2E_TMP/base.pristine" || fail "$type: the base file was modified"
done
