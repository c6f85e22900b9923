#!/usr/bin/env bash
# Real clients over NBD TLS (NBD_OPT_STARTTLS) to `vdstream serve-image --tls require`,
# certificates made here with openssl (a CA, a server certificate for localhost and
# 127.0.0.1, a target certificate urn:vdstream:target:pc-01): qemu-img info/convert and
# qemu-io with tls-creds-x509; nbdinfo, nbdcopy and nbdsh with nbds:// and nbds+unix://
# URIs and tls-certificates=; fio's nbd engine with an nbds:// URI. Bytes written over TLS
# read back equal, and the server log names the client's identity.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdinfo nbdcopy nbdsh qemu-img qemu-io
require_vdstream
e2e_init
# shellcheck source=tls-lib.sh
source "$E2E_DIR/tls-lib.sh"

make_pki "$E2E_TMP/pki"
TLS_CLIENT_DIR=$E2E_TMP/pki/client
start_tls_server --memory 64M --tls require --tls-certificates "$E2E_TMP/pki/server"

assert_eq "nbdinfo --size over nbds+unix" "$(run_bounded 20 nbdinfo --size "$TLS_URI_UNIX")" $((64 << 20))
assert_eq "nbdinfo --size over nbds://" "$(run_bounded 20 nbdinfo --size "$TLS_URI_TCP")" $((64 << 20))
grep -q "as target:pc-01" "$SERVER_LOG" || fail "the server log does not name the client's identity: $(cat "$SERVER_LOG")"
log "ok: the server knows the client as target:pc-01"

# qemu-img convert a random image in over TCP+TLS, nbdcopy it out over unix+TLS: equal.
head -c $((8 << 20)) /dev/urandom >"$E2E_TMP/src.img"
truncate -s 64M "$E2E_TMP/src.img"
TLSOBJ="tls-creds-x509,id=tls0,dir=$TLS_CLIENT_DIR,endpoint=client"
run_bounded 60 qemu-img convert -n --object "$TLSOBJ" -f raw "$E2E_TMP/src.img" \
    --target-image-opts "driver=nbd,host=127.0.0.1,port=$PORT,export=vdstream,tls-creds=tls0" \
    || fail "qemu-img convert to the TLS server failed"
run_bounded 60 nbdcopy "$TLS_URI_UNIX" "$E2E_TMP/out.img" || fail "nbdcopy from the TLS server failed"
cmp "$E2E_TMP/src.img" "$E2E_TMP/out.img" || fail "nbdcopy over TLS read other bytes than qemu-img wrote"
log "ok: qemu-img convert in, nbdcopy out, over TLS: same bytes"

out=$(run_bounded 30 qemu-img info --object "$TLSOBJ" --image-opts "driver=nbd,host=127.0.0.1,port=$PORT,export=vdstream,tls-creds=tls0")
grep -q "virtual size: 64 MiB" <<<"$out" || fail "qemu-img info over TLS: $out"
log "ok: qemu-img info over TLS"

run_bounded 60 qemu-io --object "$TLSOBJ" --image-opts "driver=nbd,host=127.0.0.1,port=$PORT,export=vdstream,tls-creds=tls0" \
    -c 'write -P 0x5a 1M 256k' -c 'read -P 0x5a 1M 256k' -c 'read -P 0 63M 4k' >"$E2E_TMP/qio.out" \
    || fail "qemu-io over TLS failed: $(cat "$E2E_TMP/qio.out")"
! grep -q "Pattern verification failed" "$E2E_TMP/qio.out" || fail "qemu-io read other bytes: $(cat "$E2E_TMP/qio.out")"
log "ok: qemu-io write and verified read over TLS"

# nbdsh -u refuses tls-certificates= (a local file) unless allowed first.
URI_TLS=$TLS_URI_TCP run_bounded 60 nbdsh -c '
import os
h.set_uri_allow_local_file(True)
h.connect_uri(os.environ["URI_TLS"])
assert h.get_tls_negotiated()
data = os.urandom(1 << 20)
for i in range(16):
    h.pwrite(data, i << 20)
for i in range(16):
    assert h.pread(1 << 20, i << 20) == data
' || fail "nbdsh over nbds:// failed"
log "ok: nbdsh 16 MiB written and read back over TLS"

fio --enghelp=nbd >/dev/null 2>&1 || fail "fio has no nbd engine (scripts/test installs a fio built with libnbd)"
# fio cannot allow tls-certificates= in a URI, so libnbd reads its default folder:
# /etc/pki/libnbd for root, $HOME/.pki/libnbd for anyone else. fio runs as a non-root
# user of a user namespace, with HOME holding the client folder (the target certificate).
mkdir -p "$E2E_TMP/home/.pki"
cp -r "$TLS_CLIENT_DIR" "$E2E_TMP/home/.pki/libnbd"
HOME=$E2E_TMP/home run_bounded 120 unshare -U --map-user=1000 --map-group=1000 fio --name=tls --ioengine=nbd \
    --uri="nbds://127.0.0.1:$PORT/vdstream" --rw=randrw --bs=4k --size=16M --verify_state_save=0 \
    --iodepth=16 --verify=crc32c --verify_fatal=1 --do_verify=1 --runtime=20 >"$E2E_TMP/fio.out" 2>&1 \
    || fail "fio's nbd engine over nbds:// failed: $(tail -20 "$E2E_TMP/fio.out")"
log "ok: fio nbd engine with verify over nbds://, with the target certificate (the server refuses anonymous clients)"
