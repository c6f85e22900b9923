#!/usr/bin/env bash
# vdstream server over a store: `nbdinfo --list` shows vdisk/NAME (described by the
# version it resolves to), each version and maintenance/NAME; vdisk/NAME serves exactly
# what `vdisk export NAME` writes, vdisk/NAME@V and @base their versions; vdisk/ exports
# refuse writes; unknown vDisks, versions and targets and malformed names are refused
# with NBD_REP_ERR_UNKNOWN and a message that names the thing.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=server-lib.sh
source "$E2E_DIR/server-lib.sh"
require nbdinfo qemu-img qemu-io cmp
require_vdstream
require_python_nbd
e2e_init
store_init

head -c 16M /dev/urandom >"$E2E_TMP/golden.img"
vds vdisk import w "$E2E_TMP/golden.img" >/dev/null
v1=$(new_patched_version w production 1M 64k 0x11)
v2=$(new_patched_version w test 2M 64k 0x22)
out=$(vds version new w)   # a maintenance version (v3)
# Its advice names both ways to the maintenance target: a server's maintenance/w export,
# and serve-image for a store no server serves.
grep -qF "exports it to the maintenance target as maintenance/w" <<<"$out" || fail "version new does not name maintenance/w: $out"
grep -qF "vdstream serve-image --vdisk w@maintenance" <<<"$out" || fail "version new does not name serve-image: $out"

start_store_server
nbdinfo --list "nbd+unix:///?socket=$SOCK" >"$E2E_TMP/list.txt"
for e in "vdisk/w" "vdisk/w@$v1" "vdisk/w@$v2" "maintenance/w"; do
    grep -q "^export=\"$e\":" "$E2E_TMP/list.txt" || fail "nbdinfo --list does not show $e: $(cat "$E2E_TMP/list.txt")"
done
grep -A1 '^export="vdisk/w":' "$E2E_TMP/list.txt" | grep -q "description: vdisk/w@$v1 (production)" \
    || fail "vdisk/w is not described as vdisk/w@$v1: $(grep -A1 '^export="vdisk/w":' "$E2E_TMP/list.txt")"
desc=$(nbdinfo --json "$(xuri vdisk/w)" | json_get /dev/stdin 'j["exports"][0]["description"]')
assert_eq "description of vdisk/w" "$desc" "vdisk/w@$v1 (production)"

for ref in "" "@$v1" "@$v2" "@base"; do
    vds vdisk export "w$ref" "$E2E_TMP/export$ref.raw" >/dev/null
    qemu-img convert -f raw -O raw "$(xuri "vdisk/w$ref")" "$E2E_TMP/served$ref.raw"
    cmp "$E2E_TMP/export$ref.raw" "$E2E_TMP/served$ref.raw" || fail "vdisk/w$ref serves other bytes than vdisk export w$ref"
    log "ok: vdisk/w$ref = vdisk export w$ref"
done
qemu-io -r -f raw -c "read -P 0x22 2M 64k" "$(xuri "vdisk/w@$v2")" >/dev/null || fail "vdisk/w@$v2 lacks its write"

if qemu-io -f raw -c "write -P 0x33 0 4k" "$(xuri vdisk/w)" >"$E2E_TMP/w.out" 2>&1; then
    fail "a write to vdisk/w succeeded"
fi
nbdinfo --json "$(xuri vdisk/w)" | json_get /dev/stdin 'j["exports"][0]["is_read_only"]' | grep -q True || fail "vdisk/w is not read-only"
log "ok: vdisk/w refuses writes"

expect_refused() { # EXPORT WORDS...
    local export=$1 got; shift
    got=$(refusal "$export")
    [[ $got == *"0x80000006"* ]] || fail "$export: want NBD_REP_ERR_UNKNOWN, got: $got"
    for w in "$@"; do
        [[ $got == *"$w"* ]] || fail "$export: the message does not say '$w': $got"
    done
    log "ok: $export refused: $got"
}
expect_refused "vdisk/nope" 'no vDisk named "nope"' "known vDisks: w"
expect_refused "vdisk/w@9" "no version 9" "$v1, $v2"
expect_refused "vdisk/w@newest" "not a version"
expect_refused "target/t1" 'no target named "t1"' "vdstream target add"
expect_refused "" "no default export" "vdisk/NAME"
expect_refused "w" "no kind"
expect_refused "vdisk/../etc" "invalid vDisk name"
expect_refused "disk/w" 'unknown kind "disk"'
expect_refused "vdisk/w@maintenance" "maintenance/w"

stop_server "$SERVER_PID" 15 || fail "the server did not stop cleanly"
