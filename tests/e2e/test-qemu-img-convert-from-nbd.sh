#!/usr/bin/env bash
# qemu-img reads a file-backed export (read-only, like a golden image) over NBD and
# converts it to a qcow2 file; qemu-img compare finds the qcow2 identical to the source,
# qemu-img check finds it clean, and the copy kept the source's holes sparse.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require qemu-img
e2e_init

src=$E2E_TMP/golden.img
make_sparse_image "$src" 64
start_server --read-only "$src"
run_bounded 120 qemu-img convert -f raw -O qcow2 "$URI" "$E2E_TMP/copy.qcow2" || fail "qemu-img convert from NBD failed"
run_bounded 120 qemu-img compare -f raw -F qcow2 "$src" "$E2E_TMP/copy.qcow2" || fail "qcow2 copy differs from the source"
run_bounded 60 qemu-img check "$E2E_TMP/copy.qcow2" >&2 || fail "qemu-img check failed on the copy"
alloc=$(du -k "$E2E_TMP/copy.qcow2" | cut -f1)
log "qcow2 copy uses ${alloc} KiB for a 64 MiB image with ~1.6 MiB of data"
((alloc < 16384)) || fail "qcow2 copy is not sparse (${alloc} KiB): holes were read as data"
