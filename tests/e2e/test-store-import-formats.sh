#!/usr/bin/env bash
# `vdisk import` takes the image formats administrators bring: vmdk, vhdx and vdi (through
# qemu-img convert) as well as raw and qcow2. Each imported vDisk serves exactly the bytes
# of the source image, and exports back to a raw file identical to it.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
require qemu-img
require_vdstream
e2e_init
store_init

make_sparse_image "$E2E_TMP/golden.raw" 16
for fmt in vmdk vhdx vdi; do
    qemu-img convert -f raw -O "$fmt" "$E2E_TMP/golden.raw" "$E2E_TMP/golden.$fmt" || fail "qemu-img cannot make a $fmt image"
    vds vdisk import "g-$fmt" "$E2E_TMP/golden.$fmt" --json >"$E2E_TMP/imp.json" 2>"$E2E_TMP/err" ||
        fail "importing a $fmt image failed: $(cat "$E2E_TMP/err")"
    size=$(vds vdisk info "g-$fmt" --json | json_get /dev/stdin 'j["meta"]["size"]')
    assert_eq "size of the vDisk imported from $fmt" "$size" $((16 << 20))
    served_raw "g-$fmt" "$E2E_TMP/served.$fmt.raw"
    cmp "$E2E_TMP/golden.raw" "$E2E_TMP/served.$fmt.raw" || fail "the vDisk imported from $fmt serves other bytes"
    vds vdisk export "g-$fmt" "$E2E_TMP/export.$fmt.raw" >/dev/null || fail "export of g-$fmt failed"
    cmp "$E2E_TMP/golden.raw" "$E2E_TMP/export.$fmt.raw" || fail "the export of g-$fmt differs from the source"
    log "ok: $fmt"
done
