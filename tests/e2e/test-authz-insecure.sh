#!/usr/bin/env bash
# Without TLS every client may open every export, so a server asked to listen where other
# machines reach it refuses to start: `vdstream server --listen ADDR` or `--http ADDR` on
# a non-loopback address, `serve-image --listen ADDR` and the agent's `target attach
# --listen ADDR`, exit with status 7 (insecure)
# before binding anything, with a message naming the address and what to do (--tls
# require --tls-certificates DIR, or --insecure). With --insecure the server starts and
# serves on that address; a unix socket and 127.0.0.1 need neither.
#
# The non-loopback address that exists is made in a network namespace of our own
# (`unshare -rn`, 10.200.0.1 added to its loopback device): nothing listens on the host's
# network. Without user namespaces that half is skipped (the refusals are still checked).
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
require nbdinfo
require_vdstream
e2e_init
store_init
vds vdisk create w --size 1M >/dev/null

# expect_insecure NAME ADDR COMMAND... — COMMAND exits at once with status 7 and says why.
expect_insecure() {
    local name=$1 addr=$2 rc=0
    shift 2
    timeout 20 "$@" >"$E2E_TMP/out.txt" 2>"$E2E_TMP/err.txt" </dev/null || rc=$?
    ((rc == 7)) || { cat "$E2E_TMP/err.txt" >&2; fail "$name: exit status $rc, want 7 (insecure)"; }
    grep -qF "refusing to listen" "$E2E_TMP/err.txt" || fail "$name: the error does not say it refuses: $(cat "$E2E_TMP/err.txt")"
    grep -qF "$addr without TLS" "$E2E_TMP/err.txt" || fail "$name: the error does not name $addr: $(cat "$E2E_TMP/err.txt")"
    grep -qF "use --tls require --tls-certificates DIR, or --insecure to accept plaintext on a trusted network" "$E2E_TMP/err.txt" \
        || fail "$name: the error does not say what to do: $(cat "$E2E_TMP/err.txt")"
    log "ok: $name refused (status 7)"
}

# 192.0.2.0/24 is TEST-NET-1: no host has it, so a bind would fail; the refusal comes first.
sock=$E2E_TMP/server.sock
expect_insecure "server --listen 192.0.2.10" "192.0.2.10:10809" \
    "$VDSTREAM_BIN" server --store "$STORE" --socket "$sock" --listen 192.0.2.10:10809
expect_insecure "server --listen 0.0.0.0" "0.0.0.0:10809" "$VDSTREAM_BIN" server --store "$STORE" --listen 0.0.0.0:10809
expect_insecure "server --listen [::]" "[::]:10809" "$VDSTREAM_BIN" server --store "$STORE" --listen '[::]:10809'
expect_insecure "server --http 192.0.2.10" "192.0.2.10:8480" \
    "$VDSTREAM_BIN" server --store "$STORE" --socket "$sock" --http 192.0.2.10:8480
expect_insecure "serve-image --listen 192.0.2.10" "192.0.2.10:10809" \
    "$VDSTREAM_BIN" serve-image --memory 1M --listen 192.0.2.10:10809
expect_insecure "target attach --listen 192.0.2.10" "192.0.2.10:10810" \
    "$VDSTREAM_BIN" target attach vm1 --server "nbd+unix:///vdisk/w?socket=$sock" --listen 192.0.2.10:10810
[[ ! -e $sock ]] || fail "a refused server created its socket $sock"

# The config file's listen counts the same.
printf 'listen = "0.0.0.0:10809"\n' >"$E2E_TMP/server.toml"
rc=0
timeout 20 "$VDSTREAM_BIN" server --store "$STORE" --config "$E2E_TMP/server.toml" >/dev/null 2>"$E2E_TMP/err.txt" </dev/null || rc=$?
((rc == 7)) || fail "listen from the config file: exit status $rc, want 7"
grep -qF "0.0.0.0:10809 without TLS" "$E2E_TMP/err.txt" || fail "listen from the config file: $(cat "$E2E_TMP/err.txt")"
log "ok: a config file's listen is refused too"

# A unix socket and loopback stay as they were.
"$VDSTREAM_BIN" server --store "$STORE" --socket "$sock" --listen 127.0.0.1:0 >"$E2E_TMP/loop.log" 2>&1 &
pid=$!
track_pid "$pid"
for ((i = 0; i < 200; i++)); do
    timeout 5 nbdinfo --list "nbd+unix:///?socket=$sock" >/dev/null 2>&1 && break
    kill -0 "$pid" 2>/dev/null || fail "the loopback server exited: $(cat "$E2E_TMP/loop.log")"
    sleep 0.1
done
timeout 5 nbdinfo --list "nbd+unix:///?socket=$sock" | grep -q "vdisk/w" || fail "the loopback server does not list vdisk/w"
stop_pid "$pid" 15
log "ok: a unix socket and 127.0.0.1 start without TLS or --insecure"

# A non-loopback address that exists, in a namespace of our own.
unshare -rn true 2>/dev/null || skip "no user network namespaces here (unshare -rn): the --insecure start is not checked"
VDSTREAM_BIN=$VDSTREAM_BIN STORE=$STORE T=$E2E_TMP timeout 120 unshare -rn bash -s <<'EOF' || fail "the namespaced half failed (see above)"
set -euo pipefail
ip link set lo up
ip addr add 10.200.0.1/32 dev lo
rc=0
timeout 20 "$VDSTREAM_BIN" server --store "$STORE" --listen 10.200.0.1:10809 >"$T/ns-out.txt" 2>"$T/ns-err.txt" </dev/null || rc=$?
if ((rc != 7)); then echo "server on 10.200.0.1 without --insecure: status $rc, want 7" >&2; cat "$T/ns-err.txt" >&2; exit 1; fi
grep -qF "10.200.0.1:10809 without TLS" "$T/ns-err.txt" || { echo "the refusal does not name 10.200.0.1:10809" >&2; exit 1; }
"$VDSTREAM_BIN" server --store "$STORE" --listen 10.200.0.1:10809 --insecure >"$T/ns.log" 2>&1 &
pid=$!
trap 'kill -KILL $pid 2>/dev/null || true' EXIT
ok=0
for ((i = 0; i < 200; i++)); do
    if timeout 5 nbdinfo --list nbd://10.200.0.1:10809 >"$T/ns-list.txt" 2>/dev/null; then ok=1; break; fi
    kill -0 "$pid" 2>/dev/null || { echo "the --insecure server exited:" >&2; cat "$T/ns.log" >&2; exit 1; }
    sleep 0.1
done
((ok == 1)) || { echo "the --insecure server does not answer on 10.200.0.1:10809" >&2; cat "$T/ns.log" >&2; exit 1; }
grep -q "vdisk/w" "$T/ns-list.txt" || { echo "the --insecure server does not list vdisk/w" >&2; exit 1; }
grep -q "without TLS on a non-loopback address (--insecure)" "$T/ns.log" || { echo "no warning in the log:" >&2; cat "$T/ns.log" >&2; exit 1; }
kill -TERM "$pid"
for ((i = 0; i < 100; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
EOF
log "ok: in a namespace, 10.200.0.1 is refused without --insecure and served with it (and the log warns)"
