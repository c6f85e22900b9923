#!/usr/bin/env bash
# A layer's format is its record's, never its first bytes'. A guest with a private vDisk
# writes a qcow2 header naming a host file into the first sector of its raw base; the
# administrator then sets the vDisk to standard. `vdstream server` (nbdinfo, nbdcopy) and
# `vdisk export` (raw and qcow2) still serve the raw bytes the guest wrote, header
# included, at the raw file's size, and the host file's marker appears nowhere; `vdisk
# info` still says the base is raw.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
source "$(dirname "$0")/server-lib.sh"
require qemu-img qemu-io nbdcopy nbdinfo
require_vdstream
is_vdstream || skip "the store is vdstream's"
e2e_init
store_init

host_secret 1

# A raw vDisk of 8 MiB, private: its one machine writes the base itself.
make_sparse_image "$E2E_TMP/base.raw" 8
vds vdisk import r "$E2E_TMP/base.raw" >/dev/null
vds vdisk set r --access private >/dev/null
# What the guest writes over its first 64 KiB: a qcow2 header (1 MiB virtual size) whose
# backing file is the host file.
qemu-img create -q -f qcow2 -F raw -b "$secret" "$E2E_TMP/evil.qcow2" 1M
head -c 65536 "$E2E_TMP/evil.qcow2" >"$E2E_TMP/header"
store_qemu_io r -c "write -s $E2E_TMP/header 0 64k"
vds vdisk set r --access standard >/dev/null
# What the base must serve: the guest's bytes.
cp "$E2E_TMP/base.raw" "$E2E_TMP/want.raw"
dd if="$E2E_TMP/header" of="$E2E_TMP/want.raw" conv=notrunc status=none
[[ $(qemu-img info --output=json -f qcow2 "$STORE/vdisks/r/r.base.raw" 2>/dev/null | json_get /dev/stdin 'j["format"]') == qcow2 ]] ||
    fail "the base does not look like a qcow2 to a probe: the test would prove nothing"

start_store_server
srv=$SOCK
size=$(nbdinfo --size "$(xuri vdisk/r)") || fail "nbdinfo vdisk/r failed: $(tail -n 5 "$SERVER_LOG")"
assert_eq "size served for vdisk/r" "$size" $((8 << 20))
nbdcopy "$(xuri vdisk/r)" "$E2E_TMP/served.raw" || fail "nbdcopy vdisk/r failed"
cmp "$E2E_TMP/want.raw" "$E2E_TMP/served.raw" || fail "vdisk/r serves other bytes than the guest wrote"
if grep -qF "$marker" "$E2E_TMP/served.raw"; then fail "vdstream server served the host file"; fi

vds vdisk export r "$E2E_TMP/export.raw" >/dev/null || fail "vdisk export r failed"
cmp "$E2E_TMP/want.raw" "$E2E_TMP/export.raw" || fail "the raw export differs from what the guest wrote"
vds vdisk export r "$E2E_TMP/export.qcow2" --format qcow2 >/dev/null || fail "vdisk export r --format qcow2 failed"
qemu-img convert -f qcow2 -O raw "$E2E_TMP/export.qcow2" "$E2E_TMP/export2.raw"
cmp "$E2E_TMP/want.raw" "$E2E_TMP/export2.raw" || fail "the qcow2 export differs from what the guest wrote"
for f in "$E2E_TMP/export.raw" "$E2E_TMP/export.qcow2"; do
    if grep -qF "$marker" "$f"; then fail "$f holds the host file"; fi
done

# A version over the base reads the same through its chain.
new_patched_version r production $((2 << 20)) 4k 0x77 >/dev/null
dd if=/dev/zero bs=4k count=1 status=none | tr '\0' '\167' | dd of="$E2E_TMP/want.raw" bs=1 seek=$((2 << 20)) conv=notrunc status=none
nbdcopy "$(xuri vdisk/r "$srv")" "$E2E_TMP/served2.raw" || fail "nbdcopy vdisk/r (version 1) failed"
cmp "$E2E_TMP/want.raw" "$E2E_TMP/served2.raw" || fail "version 1 of r serves other bytes than its chain holds"

vds vdisk info r --json >"$E2E_TMP/info.json"
assert_eq "base format in the record" "$(json_get "$E2E_TMP/info.json" 'j["meta"]["base"]["format"]')" raw
assert_eq "problems vdisk info finds in the base" "$(json_get "$E2E_TMP/info.json" 'j["layers"][0]["problems"]')" "[]"
log "ok"
