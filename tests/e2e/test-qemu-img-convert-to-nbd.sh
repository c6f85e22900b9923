#!/usr/bin/env bash
# qemu-img convert copies a sparse raw image with random data into a --memory export
# over NBD, and qemu-img compare finds the export identical to the source (and finds a
# difference after one byte of the export is changed, so the compare really compares).
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require qemu-img qemu-io
e2e_init

src=$E2E_TMP/src.img
make_sparse_image "$src" 32
start_server --memory 32M
run_bounded 120 qemu-img convert -n -f raw -O raw "$src" "$URI" || fail "qemu-img convert to NBD failed"
run_bounded 120 qemu-img compare -f raw -F raw "$src" "$URI" || fail "export differs from the source image"
log "ok: export identical to source"

run_bounded 60 qemu-io -f raw "$URI" -c 'write -P 0x42 5000000 1' >/dev/null || fail "qemu-io write failed"
rc=0
run_bounded 120 qemu-img compare -q -f raw -F raw "$src" "$URI" || rc=$?
assert_eq "qemu-img compare after changing one byte (1 = differ)" "$rc" 1
