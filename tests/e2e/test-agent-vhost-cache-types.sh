#!/usr/bin/env bash
# Every cache type through the agent's vhost-user-blk backend (--vhost-user, 2 queues),
# driven by a real vhost-user frontend (`vdstream bench vhost-user:`, libblkio's
# virtio-blk-vhost-user driver): writes carry stamps and reads check them (--verify), the
# agent's status shows the type, the guest's writes and the vhost-user figures, and what
# the frontend wrote reads back through the agent's NBD socket too. Afterwards the base
# file is byte-for-byte unchanged. A target attached `--read-only` (over a read-only
# export) is offered read-only on both paths: reads work, a writing frontend is refused,
# the NBD export says read-only and refuses a write with EPERM.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
require qemu-io cmp nbdinfo
require_vdstream
e2e_init
agent_env

base=$E2E_TMP/base.img
head -c $((32 << 20)) /dev/urandom >"$base"
cp "$base" "$E2E_TMP/base.pristine"

for type in ram-overflow device-ram device-disk device-disk-persistent server server-persistent; do
    log "==== cache type $type over vhost-user-blk ===="
    case $type in
    server*) start_server "$base" --cache "$type" --overflow-dir "$E2E_TMP" --name "srv-$type" ;;
    *) start_server "$base" --read-only ;;
    esac
    srv_pid=$SERVER_PID
    extra=()
    [[ $type == ram-overflow ]] && extra=(--ram 4M)
    [[ $type == device-ram ]] && extra=(--ram 64M)
    id=v-$type
    vsock=$VDSTREAM_RUN_DIR/$id.vhost
    start_agent "$id" --server "$URI" --cache "$type" "${extra[@]}" \
        --socket "$VDSTREAM_RUN_DIR/$id.sock" --vhost-user "$vsock" --vhost-queues 2
    [[ $(stat -c %a "$vsock") == 600 ]] || fail "$type: the vhost-user socket is not private (mode $(stat -c %a "$vsock"))"
    run_bounded 60 "$VDSTREAM_BIN" bench "vhost-user:$vsock" --workers 2 --queue-depth 8 --working-set 16M \
        --duration 2 --verify --json >"$E2E_TMP/$id.bench.json" || fail "$type: vdstream bench through vhost-user failed"
    "$PY" - "$E2E_TMP/$id.bench.json" "$type" <<'PYEOF' || fail "$type: the vhost-user run"
import json, sys
j = json.load(open(sys.argv[1]))
t, v = j["total"], j["verify"]
assert t["ops"] > 100 and j["errors"] == 0, (t, j["errors"], j["error_messages"])
assert v["checked_reads"] > 0 and v["mismatches"] == 0, v
print(f"{sys.argv[2]}: {t['ops']} requests through vhost-user-blk, {v['checked_reads']} reads checked, 0 mismatches")
PYEOF
    # The same disk through the NBD socket: a pattern written there reads back in place.
    run_bounded 60 qemu-io -f raw -c "write -P 0x5a 20000768 7168" "$URI" >/dev/null || fail "$type: qemu-io write"
    run_bounded 60 qemu-io -f raw -c "read -P 0x5a 20000768 7168" "$URI" | grep -q "read 7168/7168" || fail "$type: qemu-io read back"
    sleep 1.2
    assert_eq "$type: status cache type" "$(agent_status_get "$id" 'j["cache"]["type"]')" "$type"
    writes=$(agent_status_get "$id" 'j["guest"]["write_ops"]')
    ((writes > 100)) || fail "$type: status shows $writes guest writes"
    assert_eq "$type: vhost-user requests counted" "$(agent_status_get "$id" 'j["vhost_user"]["requests"] > 100 and j["vhost_user"]["errors"] == 0 and j["vhost_user"]["malformed"] == 0')" True
    assert_eq "$type: vhost-user frontends" "$(agent_status_get "$id" 'j["vhost_user"]["connections"]')" 1
    rc=0
    stop_server "$AGENT_PID" 15 || rc=$?
    assert_eq "$type: agent exit status" "$rc" 0
    [[ ! -e $vsock ]] || fail "$type: the vhost-user socket is left behind"
    stop_server "$srv_pid" 15 || true
    cmp "$base" "$E2E_TMP/base.pristine" || fail "$type: the base file was modified"
done

log "==== a read-only disk ===="
start_server "$base" --read-only
srv_pid=$SERVER_PID
vsock=$VDSTREAM_RUN_DIR/ro.vhost
start_agent ro --server "$URI" --read-only --socket "$VDSTREAM_RUN_DIR/ro.sock" --vhost-user "$vsock"
run_bounded 60 "$VDSTREAM_BIN" bench "vhost-user:$vsock" --workers 1 --write-pct 0 --duration 1 --json >"$E2E_TMP/ro.json" ||
    fail "reads through a read-only vhost-user disk failed"
rc=0
run_bounded 60 "$VDSTREAM_BIN" bench "vhost-user:$vsock" --workers 1 --duration 1 >"$E2E_TMP/ro-w.out" 2>&1 || rc=$?
((rc != 0)) || fail "a writing frontend was not refused by a read-only disk"
grep -qi "read-only" "$E2E_TMP/ro-w.out" || fail "the refusal does not say read-only: $(cat "$E2E_TMP/ro-w.out")"
assert_eq "the NBD export is read-only" "$(nbdinfo --is readonly "$URI" && echo yes || echo no)" yes
out=$(run_bounded 60 qemu-io -f raw -c "write -P 0x5a 0 4096" "$URI" 2>&1 || true)
grep -qi "permission denied\|read-only\|not permitted" <<<"$out" || fail "a write through the read-only NBD export was not refused: $out"
cmp "$base" "$E2E_TMP/base.pristine" || fail "the read-only attach modified the base"
log "ok: a --read-only target is offered read-only over vhost-user-blk and NBD"
stop_server "$AGENT_PID" 15 || fail "the read-only agent did not stop cleanly"
stop_server "$srv_pid" 15 || true
