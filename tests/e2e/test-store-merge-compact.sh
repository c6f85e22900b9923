#!/usr/bin/env bash
# Merges and compaction preserve every byte. Three versions (data, zeros over data, a
# discard) over a raw base; the production chain is flattened with `qemu-img convert`
# first. `version merge` folds them into one new version, `version merge --base` into a
# new qcow2 base, `vdisk compact` rewrites what is left: after each, `qemu-img compare`
# against the flattened copy finds no difference, `qemu-img check` finds no errors, and
# files nobody reads are gone. A merge refused by a rule changes nothing.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
require qemu-img qemu-io nbdinfo
require_vdstream
e2e_init
store_init

make_sparse_image "$E2E_TMP/golden.raw" 64
vds vdisk import m "$E2E_TMP/golden.raw" >/dev/null
dir=$STORE/vdisks/m
new_patched_version m production 0 4M 0x11 >/dev/null
v=$(vds version new m --json | json_get /dev/stdin 'j["version"]["number"]')
store_qemu_io m -c "write -z 1M 1M" -c "write -P 0x22 10M 64k"
vds version promote m "$v" --to production >/dev/null
v=$(vds version new m --json | json_get /dev/stdin 'j["version"]["number"]')
store_qemu_io m -c "discard 3000k 1M" -c "write -P 0x33 63M 512"
vds version promote m "$v" --to test >/dev/null

# A rule keeps production as it is: version 3 is only in test.
vds version merge m 2>"$E2E_TMP/err" && fail "merge with production on version 2 and version 3 in test was allowed"
grep -q "production targets boot version 2" "$E2E_TMP/err" || fail "the refusal does not say why: $(cat "$E2E_TMP/err")"
vds version promote m 3 --to production >/dev/null

qemu-img convert -O raw "$dir/m.3.qcow2" "$E2E_TMP/flat.raw"
vds version merge m --json >"$E2E_TMP/merge.json"
assert_eq "merged versions" "$(json_get "$E2E_TMP/merge.json" 'j["merge"]["merged"]')" "[1, 2, 3]"
new=$(json_get "$E2E_TMP/merge.json" 'j["merge"]["file"]')
assert_eq "new version file" "$new" "m.4.qcow2"
qemu-img check "$dir/$new" >/dev/null || fail "qemu-img check $new found errors"
qemu-img compare "$dir/$new" "$E2E_TMP/flat.raw" || fail "the merged version differs from the flattened chain"
assert_eq "backing of the merged version" "$(qemu-img info --output=json "$dir/$new" | json_get /dev/stdin 'j["backing-filename"]')" "m.base.raw"
for f in m.1.qcow2 m.2.qcow2 m.3.qcow2; do
    [[ ! -e $dir/$f ]] || fail "$f was merged away, nobody reads it, yet it is still there"
done
log "ok: merge preserved every byte and deleted the old files"

vds version merge m --base --json >"$E2E_TMP/base.json"
base=$(json_get "$E2E_TMP/base.json" 'j["merge"]["file"]')
assert_eq "new base" "$base" "m.base-5.qcow2"
qemu-img compare "$dir/$base" "$E2E_TMP/flat.raw" || fail "merge --base changed the content"
qemu-img check "$dir/$base" >/dev/null || fail "qemu-img check $base found errors"
[[ ! -e $dir/m.base.raw && ! -e $dir/m.4.qcow2 ]] || fail "the old base or version is still there"

# Compact: a version that writes zeros over everything it held shrinks.
v=$(vds version new m --json | json_get /dev/stdin 'j["version"]["number"]')
store_qemu_io m -c "write -P 0x44 20M 8M" -c "write -P 0 20M 8M"
vds version promote m "$v" --to production >/dev/null
before=$(stat -c %b "$dir/m.$v.qcow2")
vds vdisk compact m --json >"$E2E_TMP/compact.json"
after=$(stat -c %b "$dir/m.$v.qcow2")
((after * 4 < before)) || fail "compact did not shrink version $v ($before -> $after blocks)"
qemu-img check "$dir/m.$v.qcow2" >/dev/null || fail "qemu-img check after compact found errors"
qemu-img compare "$dir/m.$v.qcow2" "$E2E_TMP/flat.raw" || fail "compact changed the content"
log "ok: compact kept every byte ($before -> $after blocks)"
