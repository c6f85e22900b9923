#!/usr/bin/env bash
# A target whose machine vanishes without closing its TCP connection is let go: in a
# network namespace of its own, two `vdstream server`s listen on 127.0.0.1 (one with
# --dead-peer-timeout 3, one with 0 = off) and a libnbd client holds a `server` target on
# each over TCP. Then the loopback goes down, so nothing the servers send is ever
# answered — what a lost machine looks like. Within 15 s the first server drops the dead
# connection (its log says so) and a new writer of its target is accepted on the server's
# unix socket; the second still holds its target (the control: without the timeout
# nothing notices). Needs `unshare -n` (root); skipped where it cannot run.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=server-lib.sh
source "$E2E_DIR/server-lib.sh"
require unshare ip
require_vdstream
is_vdstream || skip "target/ID and --dead-peer-timeout are vdstream's"
if [[ -z ${E2E_IN_NETNS:-} ]]; then
    unshare -n true 2>/dev/null || skip "cannot make a network namespace (unshare -n needs root)"
    E2E_IN_NETNS=1 exec unshare -n bash "$0" "$@"
fi
ip link set lo up
e2e_init
store_init

golden_vdisk w 16
vds target add t1 --vdisk w --cache server >/dev/null
vds target add t0 --vdisk w --cache server >/dev/null

start_store_server --listen 127.0.0.1:10809 --dead-peer-timeout 3
sock1=$SOCK log1=$SERVER_LOG
start_store_server --listen 127.0.0.1:10810 --dead-peer-timeout 0
sock0=$SOCK

# hold URI — a libnbd client that attaches, writes a block and then sits idle.
hold() {
    "$PY" - "$1" <<'PYEOF' &
import sys, time, nbd
h = nbd.NBD()
h.connect_uri(sys.argv[1])
h.pwrite(b"\x5a" * 4096, 0)
print("holding", flush=True)
time.sleep(120)
PYEOF
    E2E_PIDS+=("$!")
}
hold nbd://127.0.0.1:10809/target/t1
hold nbd://127.0.0.1:10810/target/t0

# Both targets are held: a second writer is refused on each server's unix socket.
deadline=$((SECONDS + 20))
until [[ $(refusal target/t1 "$sock1") == *"already has its one writer"* && $(refusal target/t0 "$sock0") == *"already has its one writer"* ]]; do
    ((SECONDS < deadline)) || fail "the TCP clients did not attach: t1: $(refusal target/t1 "$sock1"); t0: $(refusal target/t0 "$sock0")"
    sleep 0.2
done
log "ok: both targets held over TCP"

ip link set lo down
start=$SECONDS
until [[ $(refusal target/t1 "$sock1") == accepted ]]; do
    ((SECONDS - start < 15)) || fail "the server with --dead-peer-timeout 3 still holds target t1 $((SECONDS - start))s after its peer vanished: $(refusal target/t1 "$sock1")"
    sleep 0.5
done
took=$((SECONDS - start))
log "ok: target t1 let go ${took}s after its peer vanished (timeout 3 s)"
grep -qiE "peer stopped answering" "$log1" || fail "the server's log does not say the connection timed out: $(tail -n 20 "$log1")"
log "ok: the server's log says why: $(grep -iE "peer stopped answering" "$log1" | head -n1)"

r=$(refusal target/t0 "$sock0")
[[ $r == *"already has its one writer"* ]] || fail "control: the server with --dead-peer-timeout 0 let go of target t0 ($r)"
log "ok: control: with --dead-peer-timeout 0 the dead connection still holds target t0"
