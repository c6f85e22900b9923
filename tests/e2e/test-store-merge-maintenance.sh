#!/usr/bin/env bash
# A merge below a maintenance version. Versions 1 and 2 in production, version 3 in
# maintenance. While the maintenance target is attached (its writer holds the file), the
# merge is refused with the holder's pid and the audit trail says it was deferred. Once it
# has stopped, versions 1 and 2 become version 4 and version 3 is re-pointed onto it: every
# selector (production, test, latest, maintenance, 3) serves the same bytes over NBD as
# before, qemu-img check and --backing-chain agree with the metadata, and the maintenance
# target can write again.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
require qemu-img qemu-io nbdinfo
require_vdstream
e2e_init
store_init

make_sparse_image "$E2E_TMP/golden.raw" 32
vds vdisk import m "$E2E_TMP/golden.raw" >/dev/null
dir=$STORE/vdisks/m
new_patched_version m production 0 4M 0x11 >/dev/null
new_patched_version m production 2M 4M 0x22 >/dev/null
v3=$(vds version new m --json | json_get /dev/stdin 'j["version"]["number"]')
store_qemu_io m -c "write -P 0x33 1M 64k" -c "write -z 5M 64k"
refs=(production test latest maintenance "$v3")
snapshot_refs m "$E2E_TMP/before" "${refs[@]}"

start_server --vdisk m@maintenance --store "$STORE"
writer=$SERVER_PID
vds version merge m 2>"$E2E_TMP/err" && fail "a merge re-pointed a maintenance version with its writer attached"
grep -q "open read-write (held by pid $writer" "$E2E_TMP/err" || fail "the refusal does not name the writer: $(cat "$E2E_TMP/err")"
vds audit m --json | python3 -c 'import json,sys; e=json.load(sys.stdin)[-1]; assert e["action"]=="version.merge.deferred" and "read-write" in e["details"]["reason"], e' \
    || fail "the deferred merge is not in the audit trail"
stop_server "$writer" 15 || fail "the maintenance server did not stop cleanly"
log "ok: the merge waits for the maintenance writer and names it"

vds version merge m --json >"$E2E_TMP/merge.json"
assert_eq "merged" "$(json_get "$E2E_TMP/merge.json" 'j["merge"]["merged"]')" "[1, 2]"
assert_eq "re-pointed" "$(json_get "$E2E_TMP/merge.json" 'j["merge"]["repointed"]')" "$v3"
assert_eq "backing of the maintenance version" "$(qemu-img info --output=json "$dir/m.$v3.qcow2" | json_get /dev/stdin 'j["backing-filename"]')" "m.4.qcow2"
[[ ! -e $dir/m.1.qcow2 && ! -e $dir/m.2.qcow2 ]] || fail "merged files nobody reads are still there"
judge_chain m
snapshot_refs m "$E2E_TMP/after" "${refs[@]}"
same_refs "$E2E_TMP/before" "$E2E_TMP/after" "${refs[@]}"
log "ok: every selector serves the same bytes after the merge"

store_qemu_io m -c "write -P 0x44 7M 64k"
vds version promote m "$v3" --to production >/dev/null
served_raw m "$E2E_TMP/prod.raw"
qemu-io -f raw -c "read -P 0x44 7M 64k" -c "read -P 0x33 1M 64k" -c "read -P 0x22 3M 64k" "$E2E_TMP/prod.raw" >/dev/null \
    || fail "the re-pointed maintenance version lost a write"
judge_chain m
log "ok: the maintenance version takes writes after the re-point and reaches production"
