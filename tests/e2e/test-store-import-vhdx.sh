#!/usr/bin/env bash
# PVS vDisks are often a VHDX base with AVHDX differencing children. qemu cannot read the
# children (it refuses a VHDX with a parent) nor create them, so vdstream reads them itself:
# `vdisk import NAME BASE.vhdx --version C1.avhdx --version C2.avhdx` makes the base (via
# qemu-img) and one version per child, each equal to what the child reads over its parent
# (qemu-img compare against the raw image make-vhdx-child.py computes beside each child).
# A chain in the wrong order, a truncated child and a child whose log needs a replay are
# refused, naming the file, and leave no vDisk.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
require qemu-img
require qemu-io
require_vdstream
e2e_init
store_init

# The base: a qemu-made VHDX with data everywhere, so a child's ZERO block shows.
qemu-img create -q -f vhdx "$E2E_TMP/base.vhdx" 16M || fail "qemu-img cannot make a VHDX"
qemu-io -c "write -P 0x55 0 7M" -c "write -P 0xaa 7M 9M" -c "write -P 0x3c 3M 5k" "$E2E_TMP/base.vhdx" >/dev/null ||
    fail "qemu-io cannot write the VHDX"
qemu-img convert -f vhdx -O raw "$E2E_TMP/base.vhdx" "$E2E_TMP/base.raw"
gen() { python3 "$E2E_DIR/make-vhdx-child.py" "$@" || fail "make-vhdx-child.py $* failed"; }
gen "$E2E_TMP/base.vhdx" "$E2E_TMP/base.raw" "$E2E_TMP/c1.avhdx" "$E2E_TMP/c1.raw" 1
gen "$E2E_TMP/c1.avhdx" "$E2E_TMP/c1.raw" "$E2E_TMP/c2.avhdx" "$E2E_TMP/c2.raw" 2
gen "$E2E_TMP/c1.avhdx" "$E2E_TMP/c1.raw" "$E2E_TMP/dirty.avhdx" "$E2E_TMP/dirty.raw" 3 --dirty-log
cmp -s "$E2E_TMP/c1.raw" "$E2E_TMP/base.raw" && fail "the first child changes nothing: a bad test"
cmp -s "$E2E_TMP/c2.raw" "$E2E_TMP/c1.raw" && fail "the second child changes nothing: a bad test"

refused() { # refused WHAT PATTERN ARGS...: the import must fail, say PATTERN, leave no vDisk
    local what=$1 pattern=$2 rc=0
    shift 2
    vds vdisk import chain "$@" >/dev/null 2>"$E2E_TMP/err" || rc=$?
    ((rc != 0)) || fail "$what was imported"
    grep -Eq "$pattern" "$E2E_TMP/err" || fail "the refusal of $what does not say /$pattern/: $(cat "$E2E_TMP/err")"
    [[ ! -e $STORE/vdisks/chain ]] || fail "the refused $what left a vDisk"
    log "ok: $what refused: $(cat "$E2E_TMP/err")"
}
refused "a chain in the wrong order" "c2.avhdx is not a child of .*base.vhdx: its parent_linkage" \
    "$E2E_TMP/base.vhdx" --version "$E2E_TMP/c2.avhdx" --version "$E2E_TMP/c1.avhdx"
head -c $(($(stat -c %s "$E2E_TMP/c1.avhdx") - (1 << 20))) "$E2E_TMP/c1.avhdx" >"$E2E_TMP/c1-cut.avhdx"
refused "a truncated child" "c1-cut.avhdx is corrupt.*truncated" \
    "$E2E_TMP/base.vhdx" --version "$E2E_TMP/c1-cut.avhdx"
refused "a child whose log needs a replay" "dirty.avhdx has a non-empty log.*Hyper-V" \
    "$E2E_TMP/base.vhdx" --version "$E2E_TMP/c1.avhdx" --version "$E2E_TMP/dirty.avhdx"
refused "a VHDX child given as the base" "c1.avhdx is itself a differencing VHDX" \
    "$E2E_TMP/c1.avhdx" --version "$E2E_TMP/c2.avhdx"

vds vdisk import chain "$E2E_TMP/base.vhdx" --version "$E2E_TMP/c1.avhdx" --version "$E2E_TMP/c2.avhdx" --json \
    >"$E2E_TMP/chain.json" 2>"$E2E_TMP/err" || fail "importing the VHDX chain failed: $(cat "$E2E_TMP/err")"
read -r v1 v2 < <(json_get "$E2E_TMP/chain.json" '" ".join(str(v["number"]) for v in j["versions"])')
[[ -n $v1 && -n $v2 ]] || fail "the chain import made no two versions: $(cat "$E2E_TMP/chain.json")"
cdir=$STORE/vdisks/chain
qemu-img compare -q -f vhdx -F qcow2 "$E2E_TMP/base.vhdx" "$cdir/chain.base.qcow2" || fail "the chain's base differs from base.vhdx"
qemu-img compare -q -f raw -F qcow2 "$E2E_TMP/c1.raw" "$cdir/chain.$v1.qcow2" || fail "version $v1 differs from c1.avhdx over base.vhdx"
qemu-img compare -q -f raw -F qcow2 "$E2E_TMP/c2.raw" "$cdir/chain.$v2.qcow2" || fail "version $v2 differs from c2.avhdx over c1.avhdx"
served_raw chain "$E2E_TMP/served.raw"
cmp "$E2E_TMP/c2.raw" "$E2E_TMP/served.raw" || fail "production (version $v2) does not serve what c2.avhdx reads"
vds vdisk check chain >/dev/null || fail "vdisk check of the imported chain failed"
log "ok: the VHDX chain imported as base + versions $v1, $v2, each equal to its source layer"
log "PASS"
