#!/usr/bin/env bash
# PVS vDisks are VHD and VHDX files. `vdisk import` takes a VHD (qemu's vpc), dynamic and
# fixed, and serves exactly its bytes (qemu-img compare against the source). Differencing
# children (a VHD of disk type 4, a VHDX with a parent: AVHDX) cannot be read by qemu —
# it refuses a VHDX with a parent and reads a differencing VHD as if it had no parent —
# so on their own they are refused with that reason instead of importing wrong bytes.
# A VHD chain imports with `--version CHILD.vhd` (read natively), one version per child,
# each equal to its layer; given in the wrong order it is refused. qemu cannot create
# differencing VHD/VHDX files, so the test makes them (make-vhd-child.py, bits set).
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
require qemu-img
require_vdstream
e2e_init
store_init

make_sparse_image "$E2E_TMP/golden.raw" 16
for sub in dynamic fixed; do
    qemu-img convert -f raw -O vpc -o "subformat=$sub,force_size=on" "$E2E_TMP/golden.raw" "$E2E_TMP/$sub.vhd" ||
        fail "qemu-img cannot make a $sub VHD"
    vds vdisk import "g-$sub" "$E2E_TMP/$sub.vhd" --json >"$E2E_TMP/imp.json" 2>"$E2E_TMP/err" ||
        fail "importing a $sub VHD failed: $(cat "$E2E_TMP/err")"
    assert_eq "source format of the $sub VHD" "$(json_get "$E2E_TMP/imp.json" 'j["import"]["source_format"]')" vpc
    assert_eq "size of the vDisk imported from a $sub VHD" "$(json_get "$E2E_TMP/imp.json" 'j["vdisk"]["size"]')" $((16 << 20))
    qemu-img compare -q -f vpc -F qcow2 "$E2E_TMP/$sub.vhd" "$STORE/vdisks/g-$sub/g-$sub.base.qcow2" ||
        fail "the base imported from the $sub VHD differs from it (qemu-img compare)"
    served_raw "g-$sub" "$E2E_TMP/served.raw"
    cmp "$E2E_TMP/golden.raw" "$E2E_TMP/served.raw" || fail "the vDisk imported from a $sub VHD serves other bytes"
    vds vdisk check "g-$sub" >/dev/null || fail "vdisk check of g-$sub failed"
    log "ok: $sub VHD imported, served and checked"
done

# A differencing VHD: the dynamic one with disk type 4 in both footer copies.
python3 - "$E2E_TMP/dynamic.vhd" "$E2E_TMP/child.vhd" <<'PY'
import struct, sys
b = bytearray(open(sys.argv[1], "rb").read())
for off in (0, len(b) - 512):
    f = b[off:off + 512]
    assert f[:8] == b"conectix", f[:8]
    f[60:64] = struct.pack(">I", 4)
    f[64:68] = b"\0\0\0\0"
    f[64:68] = struct.pack(">I", ~sum(f) & 0xFFFFFFFF)
    b[off:off + 512] = f
open(sys.argv[2], "wb").write(b)
PY
# A VHDX with a parent: the HasParent bit of its File Parameters (MS-VHDX 2.6.2.1).
qemu-img convert -f raw -O vhdx "$E2E_TMP/golden.raw" "$E2E_TMP/base.vhdx"
python3 - "$E2E_TMP/base.vhdx" "$E2E_TMP/child-named.vhdx" <<'PY'
import struct, sys, uuid
b = bytearray(open(sys.argv[1], "rb").read())
rt = 192 << 10
assert b[rt:rt + 4] == b"regi"
meta_guid = uuid.UUID("8B7CA206-4790-4B9A-B8FE-575F050F886E").bytes_le
fp_guid = uuid.UUID("CAA16737-FA36-4D43-B3B6-33F0AA44E76B").bytes_le
n = struct.unpack_from("<I", b, rt + 8)[0]
meta = next(struct.unpack_from("<Q", b, rt + 16 + 32 * i + 16)[0] for i in range(n) if b[rt + 16 + 32 * i:rt + 32 + 32 * i] == meta_guid)
assert b[meta:meta + 8] == b"metadata"
entries = struct.unpack_from("<H", b, meta + 10)[0]
item = next(struct.unpack_from("<I", b, meta + 32 + 32 * i + 16)[0] for i in range(entries) if b[meta + 32 + 32 * i:meta + 48 + 32 * i] == fp_guid)
flags = struct.unpack_from("<I", b, meta + item + 4)[0]
struct.pack_into("<I", b, meta + item + 4, flags | 2)
open(sys.argv[2], "wb").write(b)
PY
cp "$E2E_TMP/base.vhdx" "$E2E_TMP/child.avhdx"
for child in child.vhd child-named.vhdx child.avhdx; do
    rc=0
    vds vdisk import c "$E2E_TMP/$child" >/dev/null 2>"$E2E_TMP/err" || rc=$?
    ((rc != 0)) || fail "the differencing image $child was imported"
    grep -Eq "$child is a differencing VHDX? .*merge the chain into its base first" "$E2E_TMP/err" ||
        fail "the refusal of $child does not say why and what to do: $(cat "$E2E_TMP/err")"
    log "ok: $child refused: $(cat "$E2E_TMP/err")"
done
[[ ! -e $STORE/vdisks/c ]] || fail "a refused import left a vDisk"
vds vdisk import b "$E2E_TMP/base.vhdx" >/dev/null || fail "the VHDX base itself does not import"

# A PVS VHD chain: base.vhd <- c1.vhd <- c2.vhd, imported as the base and two versions.
# Each version must read what its child reads over its parent (make-vhd-child.py writes
# that as a raw file beside each child); qemu-img compares each version file with it.
cp "$E2E_TMP/dynamic.vhd" "$E2E_TMP/p.vhd"
python3 "$E2E_DIR/make-vhd-child.py" "$E2E_TMP/p.vhd" "$E2E_TMP/golden.raw" "$E2E_TMP/c1.vhd" "$E2E_TMP/c1.raw" 1
python3 "$E2E_DIR/make-vhd-child.py" "$E2E_TMP/c1.vhd" "$E2E_TMP/c1.raw" "$E2E_TMP/c2.vhd" "$E2E_TMP/c2.raw" 2
cmp -s "$E2E_TMP/c1.raw" "$E2E_TMP/golden.raw" && fail "the first child changes nothing: a bad test"
rc=0
vds vdisk import chain "$E2E_TMP/p.vhd" --version "$E2E_TMP/c2.vhd" --version "$E2E_TMP/c1.vhd" >/dev/null 2>"$E2E_TMP/err" || rc=$?
((rc != 0)) || fail "a chain in the wrong order was imported"
grep -q "c2.vhd is not a child of .*p.vhd" "$E2E_TMP/err" || fail "the wrong order is not named: $(cat "$E2E_TMP/err")"
[[ ! -e $STORE/vdisks/chain ]] || fail "the refused chain left a vDisk"
log "ok: a chain in the wrong order is refused: $(cat "$E2E_TMP/err")"
head -c $(($(stat -c %s "$E2E_TMP/c1.vhd") - (1 << 20))) "$E2E_TMP/c1.vhd" >"$E2E_TMP/c1-cut.vhd"
rc=0
vds vdisk import chain "$E2E_TMP/p.vhd" --version "$E2E_TMP/c1-cut.vhd" >/dev/null 2>"$E2E_TMP/err" || rc=$?
((rc != 0)) || fail "a truncated child was imported"
grep -q "c1-cut.vhd is corrupt.*truncated" "$E2E_TMP/err" || fail "the truncated child is not named: $(cat "$E2E_TMP/err")"
[[ ! -e $STORE/vdisks/chain ]] || fail "the refused truncated child left a vDisk"
log "ok: a truncated child is refused: $(cat "$E2E_TMP/err")"
vds vdisk import chain "$E2E_TMP/p.vhd" --version "$E2E_TMP/c1.vhd" --version "$E2E_TMP/c2.vhd" --json >"$E2E_TMP/chain.json" 2>"$E2E_TMP/err" ||
    fail "importing the VHD chain failed: $(cat "$E2E_TMP/err")"
read -r v1 v2 < <(json_get "$E2E_TMP/chain.json" '" ".join(str(v["number"]) for v in j["versions"])')
[[ -n $v1 && -n $v2 ]] || fail "the chain import made no two versions: $(cat "$E2E_TMP/chain.json")"
cdir=$STORE/vdisks/chain
qemu-img compare -q -f vpc -F qcow2 "$E2E_TMP/p.vhd" "$cdir/chain.base.qcow2" || fail "the chain's base differs from p.vhd"
qemu-img compare -q -f raw -F qcow2 "$E2E_TMP/c1.raw" "$cdir/chain.$v1.qcow2" || fail "version $v1 differs from c1.vhd over p.vhd"
qemu-img compare -q -f raw -F qcow2 "$E2E_TMP/c2.raw" "$cdir/chain.$v2.qcow2" || fail "version $v2 differs from c2.vhd over c1.vhd"
served_raw chain "$E2E_TMP/served.raw"
cmp "$E2E_TMP/c2.raw" "$E2E_TMP/served.raw" || fail "production (version $v2) does not serve what c2.vhd reads"
vds vdisk check chain >/dev/null || fail "vdisk check of the imported chain failed"
log "ok: the VHD chain imported as base + versions $v1, $v2, each equal to its source layer"
log "PASS"
