#!/usr/bin/env bash
# Damaged images are found, not served as if whole:
# - `vdisk import` refuses a truncated qcow2 and a truncated VHDX (qemu-img convert would
#   read zeros for the missing part and import wrong bytes), naming the file and the
#   problem, with nothing left in the store; into a store that did not exist, the refused
#   import (and a refused `vdisk create`) leaves no store and no folder behind;
# - `vdisk info` reports a truncated, a missing and a mis-pointed layer as damaged;
# - `vdisk check NAME[@V]` (qemu-img check of every layer plus the metadata) passes a
#   sound vDisk and fails, naming the layer, on each of those; a vDisk or a version that
#   does not exist exits 3 (not found), naming it and what there is.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
require qemu-img qemu-io nbdinfo
require_vdstream
e2e_init
store_init

# expect_fail WHAT PATTERN CMD... — CMD exits non-zero and its stderr matches PATTERN.
expect_fail() {
    local what=$1 pattern=$2; shift 2
    local rc=0
    "$@" >"$E2E_TMP/out" 2>"$E2E_TMP/err" || rc=$?
    ((rc != 0)) || fail "$what: the command succeeded: $*"
    grep -Eq -- "$pattern" "$E2E_TMP/err" || fail "$what: stderr does not match '$pattern': $(cat "$E2E_TMP/err")"
    log "ok: $what: exit $rc: $(head -c 220 "$E2E_TMP/err")"
}

# Sources: 16 MiB with 8 MiB of data, then cut to half their length.
qemu-img create -q -f qcow2 "$E2E_TMP/src.qcow2" 16M
qemu-io -f qcow2 -c 'write -P 0x5a 0 8M' "$E2E_TMP/src.qcow2" >/dev/null
cp "$E2E_TMP/src.qcow2" "$E2E_TMP/cut.qcow2"
truncate -s $(($(stat -c %s "$E2E_TMP/src.qcow2") / 2)) "$E2E_TMP/cut.qcow2"
qemu-img create -q -f vhdx "$E2E_TMP/src.vhdx" 16M
qemu-io -f vhdx -c 'write -P 0x6b 0 8M' "$E2E_TMP/src.vhdx" >/dev/null
cp "$E2E_TMP/src.vhdx" "$E2E_TMP/cut.vhdx"
truncate -s 6M "$E2E_TMP/cut.vhdx"

vds vdisk create keep --size 16M >/dev/null # the store exists; a refused import adds nothing
expect_fail "truncated qcow2 import" "cut\.qcow2.*(truncated|past the end)" vds vdisk import bad "$E2E_TMP/cut.qcow2"
expect_fail "truncated vhdx import" "cut\.vhdx.*(truncated|past the end|after end of file)" vds vdisk import bad "$E2E_TMP/cut.vhdx"
[[ $(ls -A "$STORE/vdisks") == keep ]] || fail "a refused import left something: $(ls -A "$STORE/vdisks")"
vds vdisk list --json | grep -q '"bad"' && fail "a refused import is listed"

# Into a store that does not exist yet: refused, and neither the store nor the folders
# made for it stay. A folder that existed before stays (empty, as it was).
fresh=$E2E_TMP/fresh
expect_fail "truncated qcow2 import into a new store" "cut\.qcow2.*(truncated|past the end)" \
    "$VDSTREAM_BIN" vdisk import bad "$E2E_TMP/cut.qcow2" --store "$fresh/deeper/store"
[[ ! -e $fresh ]] || fail "a refused import into a new store left $(find "$fresh" | tr '\n' ' ')"
expect_fail "create with a bad size into a new store" "size 1 bytes is not allowed" \
    "$VDSTREAM_BIN" vdisk create bad --size 1 --store "$fresh/store"
[[ ! -e $fresh ]] || fail "a refused create into a new store left $(find "$fresh" | tr '\n' ' ')"
mkdir "$E2E_TMP/empty"
expect_fail "truncated qcow2 import into an empty folder" "cut\.qcow2" \
    "$VDSTREAM_BIN" vdisk import bad "$E2E_TMP/cut.qcow2" --store "$E2E_TMP/empty"
[[ -d $E2E_TMP/empty && -z $(ls -A "$E2E_TMP/empty") ]] || fail "a refused import left files in an existing empty folder: $(ls -A "$E2E_TMP/empty")"
log "ok: a refused import or create into a new store leaves nothing behind"

# A sound vDisk: an imported base and a version with data.
vds vdisk import d "$E2E_TMP/src.qcow2" >/dev/null
v=$(new_patched_version d production 4M 1M 0x77)
vds vdisk check d >"$E2E_TMP/out" || fail "vdisk check of a sound vDisk failed: $(cat "$E2E_TMP/out")"
grep -q "no problems" "$E2E_TMP/out" || fail "vdisk check does not say the vDisk is sound: $(cat "$E2E_TMP/out")"
vds vdisk check d --json >"$E2E_TMP/check.json"
assert_eq "check ok" "$(json_get "$E2E_TMP/check.json" 'j["ok"]')" True
assert_eq "layers checked" "$(json_get "$E2E_TMP/check.json" 'len(j["layers"])')" 2
assert_eq "qemu-img check verdicts" "$(json_get "$E2E_TMP/check.json" '[l["qemu_check"]["verdict"] for l in j["layers"]]')" "['clean', 'clean']"
vds vdisk check d@base --json >"$E2E_TMP/check.json"
assert_eq "layers checked for d@base" "$(json_get "$E2E_TMP/check.json" 'len(j["layers"])')" 1
vds vdisk info d --json >"$E2E_TMP/info.json"
assert_eq "problems of a sound vDisk" "$(json_get "$E2E_TMP/info.json" '[l["problems"] for l in j["layers"]]')" "[[], []]"

dir=$STORE/vdisks/d
vfile=$dir/d.$v.qcow2
cp "$vfile" "$E2E_TMP/v.keep"

# damaged WHAT PATTERN — vdisk info names the version's problem (and exits 0: it
# reports), vdisk check fails naming the file and the problem.
damaged() {
    local what=$1 pattern=$2
    vds vdisk info d >"$E2E_TMP/info.txt" || fail "vdisk info failed on a $what layer"
    grep -Eq "DAMAGED: .*$pattern" "$E2E_TMP/info.txt" || fail "vdisk info does not report the $what layer: $(cat "$E2E_TMP/info.txt")"
    grep -q "vdstream vdisk check d" "$E2E_TMP/info.txt" || fail "vdisk info does not say how to check in full"
    vds vdisk info d --json >"$E2E_TMP/info.json"
    json_get "$E2E_TMP/info.json" '"; ".join(j["layers"][1]["problems"])' | grep -Eq "$pattern" ||
        fail "vdisk info --json does not list the problem of the $what layer: $(cat "$E2E_TMP/info.json")"
    log "ok: vdisk info reports the $what layer: $(grep DAMAGED "$E2E_TMP/info.txt")"
    expect_fail "vdisk check, $what layer" "1 of 2 layer\(s\) damaged" vds vdisk check d
    grep -Eq "d\.$v\.qcow2 +DAMAGED: .*$pattern" "$E2E_TMP/out" || fail "vdisk check does not name the $what layer: $(cat "$E2E_TMP/out")"
    local rc=0
    vds vdisk check d --json >"$E2E_TMP/check.json" 2>/dev/null || rc=$?
    ((rc == 5)) || fail "vdisk check --json exits $rc, not 5 (I/O: a damaged store file), on a $what layer"
    assert_eq "check --json ok, $what layer" "$(json_get "$E2E_TMP/check.json" 'j["ok"]')" False
}

truncate -s $(($(stat -c %s "$vfile") - 512 * 1024)) "$vfile"
damaged truncated "truncated"
grep -q "qemu-img check found" "$E2E_TMP/out" || fail "vdisk check does not give qemu-img check's verdict: $(cat "$E2E_TMP/out")"

mv "$vfile" "$E2E_TMP/v.moved"
damaged missing "missing"

cp "$E2E_TMP/v.keep" "$vfile"
qemu-img create -q -f qcow2 "$dir/stray.qcow2" 16M
qemu-img rebase -q -u -f qcow2 -b stray.qcow2 -F qcow2 "$vfile"
damaged mis-pointed "backs onto stray\.qcow2, but the layer below it is d\.base\.qcow2"

cp "$E2E_TMP/v.keep" "$vfile"
rm -f "$dir/stray.qcow2"
vds vdisk check d >/dev/null || fail "vdisk check fails after the file was restored"
log "ok: restored, vdisk check passes again"

# expect_status WHAT STATUS PATTERN CMD... — CMD exits with STATUS, stderr matches PATTERN.
expect_status() {
    local what=$1 want=$2 pattern=$3; shift 3
    local rc=0
    "$@" >"$E2E_TMP/out" 2>"$E2E_TMP/err" || rc=$?
    ((rc == want)) || fail "$what: exit status $rc, want $want: $(cat "$E2E_TMP/err")"
    grep -Eq -- "$pattern" "$E2E_TMP/err" || fail "$what: stderr does not match '$pattern': $(cat "$E2E_TMP/err")"
    log "ok: $what: exit $rc: $(head -c 160 "$E2E_TMP/err")"
}
expect_status "check of a missing vDisk" 3 'no vDisk named "nope".*known vDisks: .*d' vds vdisk check nope
expect_status "check of a missing version" 3 "vDisk d has no version 9; its versions are: $v" vds vdisk check d@9
expect_status "check of a missing version (--json)" 3 "has no version 9" vds vdisk check d@9 --json
grep -q '"not_found"' "$E2E_TMP/out" || fail "--json error of a missing version is not not_found: $(cat "$E2E_TMP/out")"
log "PASS"
