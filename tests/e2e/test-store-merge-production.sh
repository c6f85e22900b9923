#!/usr/bin/env bash
# Merges stop at what production boots. Version 1 and 2 in production, 3 in test, 4
# released to production two hours from now, 5 in maintenance: `version merge` folds 1 and
# 2 into 6 and re-points 3 onto it; 3, 4, 5 keep their numbers and access. An override
# then pins 3: the next merge folds 6 and 3 into 7 and moves the override to 7. After each,
# every selector (production, test, latest, maintenance, each version left) serves the
# same bytes over NBD as before (a merged version as the one that replaced it), and
# qemu-img check and --backing-chain agree with the metadata.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
require qemu-img qemu-io nbdinfo
require_vdstream
e2e_init
store_init

make_sparse_image "$E2E_TMP/golden.raw" 32
vds vdisk import p "$E2E_TMP/golden.raw" --max-versions 9 >/dev/null
new_patched_version p production 0 2M 0x11 >/dev/null
new_patched_version p production 1M 2M 0x22 >/dev/null
new_patched_version p test 0 64k 0x33 >/dev/null
v4=$(vds version new p --json | json_get /dev/stdin 'j["version"]["number"]')
store_qemu_io p -c "write -P 0x44 8M 1M"
vds version promote p "$v4" --to production --at +2h >/dev/null
v5=$(vds version new p --json | json_get /dev/stdin 'j["version"]["number"]')
store_qemu_io p -c "write -P 0x55 12M 1M"

refs=(production test latest maintenance 2 3 4 5)
snapshot_refs p "$E2E_TMP/b1" "${refs[@]}"
vds version merge p --json >"$E2E_TMP/m1.json"
assert_eq "merged" "$(json_get "$E2E_TMP/m1.json" 'j["merge"]["merged"]')" "[1, 2]"
assert_eq "new version" "$(json_get "$E2E_TMP/m1.json" 'j["merge"]["new_layer"]')" "{'version': 6}"
vds vdisk info p --json >"$E2E_TMP/info.json"
assert_eq "versions" "$(json_get "$E2E_TMP/info.json" '[(v["number"], v["access"]) for v in j["meta"]["versions"]]')" \
    "[(6, 'production'), (3, 'test'), (4, 'production'), (5, 'maintenance')]"
judge_chain p
snapshot_refs p "$E2E_TMP/a1" production test latest maintenance 3 4 5 6
same_refs "$E2E_TMP/b1" "$E2E_TMP/a1" production test latest maintenance 3 4 5 2=6
log "ok: versions 1 and 2 became 6 below test, scheduled and maintenance versions, same bytes everywhere"

vds version override p 3 >/dev/null
snapshot_refs p "$E2E_TMP/b2" production test latest maintenance 3 4 5
vds version merge p --base 2>"$E2E_TMP/err" && fail "merge --base dropped an override pinned below other versions"
grep -q "override" "$E2E_TMP/err" || fail "the refusal does not name the override: $(cat "$E2E_TMP/err")"
vds version merge p --json >"$E2E_TMP/m2.json"
assert_eq "merged" "$(json_get "$E2E_TMP/m2.json" 'j["merge"]["merged"]')" "[6, 3]"
assert_eq "override moved" "$(json_get "$E2E_TMP/m2.json" 'j["merge"]["override"]')" "{'from': 3, 'to': 7}"
assert_eq "override" "$(vds vdisk info p --json | json_get /dev/stdin 'j["meta"]["override"]')" "7"
vds audit p --json | python3 -c 'import json,sys; e=[e for e in json.load(sys.stdin) if e["action"]=="version.merge"][-1]; assert e["details"]["override"]=={"from":3,"to":7}, e' \
    || fail "the audit trail does not record the override's move"
judge_chain p
snapshot_refs p "$E2E_TMP/a2" production test latest maintenance 4 5 7
same_refs "$E2E_TMP/b2" "$E2E_TMP/a2" production test latest maintenance 4 5 3=7
log "ok: the override moved from 3 to 7 with the merge; same bytes everywhere"
