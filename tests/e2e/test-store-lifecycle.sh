#!/usr/bin/env bash
# The store's version life cycle with real tools: import a raw image, make a maintenance
# version, write to it through `serve-image --vdisk NAME@maintenance` with qemu-io,
# promote it to test then production. Every version file passes `qemu-img check` and
# `qemu-img info --backing-chain` shows the chain; `qemu-img convert` of each version
# file to raw is byte-identical (cmp) to what serve-image serves for that version, and to
# `vdisk export`; block status reports holes and zeros through the chain. qcow2 import goes through qemu-img; the audit trail has every step.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
require qemu-img qemu-io nbdinfo
require_vdstream
e2e_init
store_init

make_sparse_image "$E2E_TMP/golden.raw" 64
out=$(vds vdisk import win "$E2E_TMP/golden.raw")
grep -q "created a new store" <<<"$out" || fail "import did not say it created the store: $out"
v1=$(new_patched_version win test 1M 2M 0xa1)
v2=$(new_patched_version win production 5M 3M 0xb2)
assert_eq "version numbers" "$v1 $v2" "1 2"
vds version promote win "$v1" --to production >/dev/null
v3=$(vds version new win --note "next patch" --json | json_get /dev/stdin 'j["version"]["number"]')
store_qemu_io win -c "write -P 0xc3 0 64k" -c "write -z 1M 64k" -c "discard 5M 1M"

vds vdisk info win --json >"$E2E_TMP/info.json"
assert_eq "production gets" "$(json_get "$E2E_TMP/info.json" 'j["production"]')" "{'version': 2}"
assert_eq "maintenance" "$(json_get "$E2E_TMP/info.json" 'j["maintenance"]')" "$v3"

dir=$STORE/vdisks/win
for v in 1 2 3; do
    f=$dir/win.$v.qcow2
    qemu-img check "$f" >/dev/null || fail "qemu-img check $f found errors"
    chain=$(qemu-img info --backing-chain "$f" | grep -c '^image:')
    assert_eq "layers in the chain of version $v" "$chain" $((v + 1))
    qemu-img convert -O raw "$f" "$E2E_TMP/flat$v.raw"
    served_raw "win@$v" "$E2E_TMP/served$v.raw"
    cmp "$E2E_TMP/flat$v.raw" "$E2E_TMP/served$v.raw" || fail "version $v: served bytes differ from qemu-img convert"
    log "ok: version $v served = qemu-img convert of its file"
done
cmp -s "$E2E_TMP/flat2.raw" "$E2E_TMP/flat3.raw" && fail "version 3 should differ from version 2"

# Block status through the chain: the discard in version 3 over version 2's data reads as
# zeros, and what no layer holds (the raw base's holes) is a hole.
start_server --vdisk win@3 --store "$STORE" --read-only
nbdinfo --map --json "$URI" >"$E2E_TMP/map.json"
stop_server "$SERVER_PID" 15 || fail "the server of win@3 did not stop cleanly"
covers() { json_get "$E2E_TMP/map.json" "any(e['offset'] <= $1 and e['offset'] + e['length'] >= $2 and e['type'] & $3 for e in j)"; }
assert_eq "5M..6M (discarded over data) reads as zeros" "$(covers $((5 << 20)) $((6 << 20)) 2)" True
assert_eq "20M..30M (held by no layer) is a hole" "$(covers $((20 << 20)) $((30 << 20)) 1)" True
assert_eq "1M+64k..3M (version 1's data) has no zero extent" \
    "$(json_get "$E2E_TMP/map.json" "any(e['offset'] < $((3 << 20)) and e['offset'] + e['length'] > $(((1 << 20) + 65536)) and e['type'] & 2 for e in j)")" False
served_raw win "$E2E_TMP/prod.raw"
cmp "$E2E_TMP/prod.raw" "$E2E_TMP/flat2.raw" || fail "NAME without @V is not what production gets"

vds vdisk export win@3 "$E2E_TMP/export3.raw" >/dev/null
cmp "$E2E_TMP/export3.raw" "$E2E_TMP/flat3.raw" || fail "export of version 3 differs"
vds vdisk export win@2 "$E2E_TMP/export2.qcow2" --format qcow2 >/dev/null
qemu-img compare -q "$E2E_TMP/export2.qcow2" "$E2E_TMP/flat2.raw" || fail "qcow2 export of version 2 differs"
vds vdisk export win@2 "$E2E_TMP/export3.raw" 2>"$E2E_TMP/err" && fail "export overwrote a file without --force"
grep -q -- "--force" "$E2E_TMP/err" || fail "the refusal does not mention --force"

# qcow2 import goes through qemu-img convert.
qemu-img convert -O qcow2 "$E2E_TMP/flat3.raw" "$E2E_TMP/src.qcow2"
vds vdisk import fromq "$E2E_TMP/src.qcow2" --json >"$E2E_TMP/imp.json"
assert_eq "import method" "$(json_get "$E2E_TMP/imp.json" 'j["import"]["method"]')" "qemu-img convert"
served_raw fromq "$E2E_TMP/fromq.raw"
cmp "$E2E_TMP/fromq.raw" "$E2E_TMP/flat3.raw" || fail "imported qcow2 differs"

vds vdisk list --json >"$E2E_TMP/list.json"
assert_eq "vDisks listed" "$(json_get "$E2E_TMP/list.json" 'sorted(d["name"] for d in j)')" "['fromq', 'win']"
vds audit win --json >"$E2E_TMP/audit.json"
assert_eq "audited actions" "$(json_get "$E2E_TMP/audit.json" '" ".join(e["action"] for e in j)')" \
    "vdisk.import version.new version.promote version.new version.promote version.promote version.new"
log "ok: the audit trail has every step"
