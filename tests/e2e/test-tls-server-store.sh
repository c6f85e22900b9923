#!/usr/bin/env bash
# `vdstream server --tls require` on a store: nbdinfo --list and qemu-img convert of
# vdisk/NAME over nbds:// (127.0.0.1) read the imported bytes, the server prints nbds://
# URIs, a plaintext client gets TLS_REQD, and --tls-certificates without --tls on|require
# is refused at start.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
require nbdinfo qemu-img cmp
require_vdstream
e2e_init
store_init
# shellcheck source=tls-lib.sh
source "$E2E_DIR/tls-lib.sh"

make_pki "$E2E_TMP/pki"
head -c 16M /dev/urandom >"$E2E_TMP/golden.img"
vds vdisk import w "$E2E_TMP/golden.img" >/dev/null
# The client certificate is target pc-01's: the server lets a target read its record's vDisk.
vds target add pc-01 --vdisk w --cache device-disk >/dev/null
port=$(free_port)
log "starting: vdstream server --store $STORE --listen 127.0.0.1:$port --tls require"
"$VDSTREAM_BIN" server --store "$STORE" --listen "127.0.0.1:$port" --tls require \
    --tls-certificates "$E2E_TMP/pki/server" >"$E2E_TMP/server.log" 2>&1 </dev/null &
SERVER_PID=$!
track_pid "$SERVER_PID"
E2E_SERVER_PIDS+=("$SERVER_PID")
E2E_SERVER_LOGS+=("$E2E_TMP/server.log")
uri="nbds://127.0.0.1:$port/vdisk/w?tls-certificates=$E2E_TMP/pki/client"
for _ in $(seq 100); do
    server_alive || fail "the server exited: $(cat "$E2E_TMP/server.log")"
    timeout 5 nbdinfo --size "$uri" >/dev/null 2>&1 && break
    sleep 0.2
done
assert_eq "size of vdisk/w over TLS" "$(run_bounded 20 nbdinfo --size "$uri")" $((16 << 20))
run_bounded 20 nbdinfo --list "nbds://127.0.0.1:$port/?tls-certificates=$E2E_TMP/pki/client" | grep -q 'export="vdisk/w"' \
    || fail "nbdinfo --list over TLS does not show vdisk/w"
grep -q "serving nbds://127.0.0.1:$port/EXPORT" "$E2E_TMP/server.log" || fail "the server does not print its nbds:// URI"
run_bounded 60 qemu-img convert -O raw --object "tls-creds-x509,id=tls0,dir=$E2E_TMP/pki/client,endpoint=client" \
    --image-opts "driver=nbd,host=127.0.0.1,port=$port,export=vdisk/w,tls-creds=tls0" "$E2E_TMP/out.img" \
    || fail "qemu-img convert over TLS failed"
cmp "$E2E_TMP/golden.img" "$E2E_TMP/out.img" || fail "vdisk/w over TLS differs from the imported image"
log "ok: qemu-img read vdisk/w over TLS"
rc=0
out=$(run_bounded 20 nbdinfo --size "nbd://127.0.0.1:$port/vdisk/w" 2>&1) || rc=$?
((rc != 0)) && grep -qi "TLS" <<<"$out" || fail "a plaintext client was served: $out"
log "ok: plaintext refused: $out"
stop_server || fail "the server did not stop cleanly"

rc=0
out=$("$VDSTREAM_BIN" server --store "$STORE" --socket "$E2E_TMP/x.sock" --tls-certificates "$E2E_TMP/pki/server" 2>&1) || rc=$?
((rc != 0)) && grep -q -- "--tls on or --tls require" <<<"$out" || fail "--tls-certificates with --tls off started: $out"
log "ok: --tls-certificates without --tls refused"
