#!/usr/bin/env bash
# A server that cannot bind one of its ports leaves nothing behind: with --socket S and a
# busy --listen (NBD) or --http (API) port, `vdstream server` exits at once with status 4
# (conflict: docs/ADMIN.md, "Scripts") and a message naming the address, and S
# does not exist afterwards (nor does a later server on S have to clean up after it).
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
require nbdinfo
require_vdstream
e2e_init
store_init
vds vdisk create w --size 1M >/dev/null

# A port someone else holds, for the whole test.
"$PY" -c '
import socket, sys, time
s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen()
print(s.getsockname()[1], flush=True)
time.sleep(120)' >"$E2E_TMP/port" &
track_pid $!
for ((i = 0; i < 100; i++)); do [[ -s $E2E_TMP/port ]] && break; sleep 0.1; done
port=$(cat "$E2E_TMP/port")
[[ -n $port ]] || fail "the port holder did not start"

for flag in --listen --http; do
    sock=$E2E_TMP/s${flag#--}.sock
    rc=0
    timeout 30 "$VDSTREAM_BIN" server --store "$STORE" --socket "$sock" "$flag" "127.0.0.1:$port" \
        >"$E2E_TMP/out.txt" 2>"$E2E_TMP/err.txt" </dev/null || rc=$?
    cat "$E2E_TMP/err.txt" >&2
    ((rc != 0 && rc != 124)) || fail "server $flag on a busy port: status $rc, want a failure at once"
    ((rc == 4)) || fail "server $flag on a busy port: exit status $rc, want 4 (conflict: address in use)"
    grep -q "127.0.0.1:$port" "$E2E_TMP/err.txt" || fail "server $flag: the error does not name the address"
    grep -qi "in use" "$E2E_TMP/err.txt" || fail "server $flag: the error does not say the port is in use"
    [[ ! -e $sock ]] || fail "server $flag on a busy port left its NBD socket $sock behind"
    log "ok: $flag on a busy port: status $rc, socket file gone"
done

# The socket path is clean for the next server.
sock=$E2E_TMP/next.sock
"$VDSTREAM_BIN" server --store "$STORE" --socket "$sock" >"$E2E_TMP/next.log" 2>&1 &
pid=$!
track_pid "$pid"
for ((i = 0; i < 200; i++)); do
    timeout 5 nbdinfo --list "nbd+unix:///?socket=$sock" >/dev/null 2>&1 && break
    kill -0 "$pid" 2>/dev/null || fail "the next server exited: $(cat "$E2E_TMP/next.log")"
    sleep 0.1
done
timeout 5 nbdinfo --list "nbd+unix:///?socket=$sock" >/dev/null || fail "the next server does not answer"
stop_pid "$pid" 15
wait "$pid" || fail "the next server did not stop cleanly"
[[ ! -e $sock ]] || fail "a drained server left its socket behind"
log "ok: the next server serves on the same path and removes it at exit"
