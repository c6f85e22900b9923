#!/usr/bin/env bash
# Target records in the store: `target add|list|show|set|remove` with --json and human
# output; records are files under STORE/targets written atomically, every change is in
# the audit trail; bad ids, unknown vDisks and cache types, `private`, --ram on a type
# without RAM, a missing version and a second add of one id are refused with the reason
# and change nothing; a vDisk that targets boot cannot be deleted (the targets are named).
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
require_vdstream
e2e_init
store_init

expect_error() {
    local what=$1 pattern=$2; shift 2
    local rc=0
    "$@" >"$E2E_TMP/out" 2>"$E2E_TMP/err" || rc=$?
    ((rc != 0)) || fail "$what: the command succeeded: $*"
    grep -Eq -- "$pattern" "$E2E_TMP/err" || fail "$what: stderr does not match '$pattern': $(cat "$E2E_TMP/err")"
    log "ok: $what refused: $(head -c 160 "$E2E_TMP/err")"
}

vds vdisk create win --size 16M >/dev/null
vds vdisk create lin --size 16M >/dev/null
v=$(vds version new win --json | json_get /dev/stdin 'j["version"]["number"]')
vds version promote win "$v" --to test >/dev/null

out=$(vds target add vm1 --vdisk win --cache ram-overflow --ram 512M --overflow-max 2G --description "lab PC 1")
grep -q "added target vm1: vDisk win" <<<"$out" || fail "target add said: $out"
vds target add vm2 --vdisk win --cache server --version test --json >"$E2E_TMP/vm2.json"
assert_eq "vm2 version" "$(json_get "$E2E_TMP/vm2.json" 'j["version"]')" test
assert_eq "vm2 cache" "$(json_get "$E2E_TMP/vm2.json" 'j["cache"]')" server
vds target add vm3 --vdisk lin --cache device-ram --ram 64M --version "$v" 2>"$E2E_TMP/err" && fail "version $v of lin does not exist"
grep -q "has no version $v" "$E2E_TMP/err" || fail "missing version: $(cat "$E2E_TMP/err")"

# The record is a JSON file in the store, sizes in bytes.
[[ -f $STORE/targets/vm1.json ]] || fail "no $STORE/targets/vm1.json"
assert_eq "vm1 ram in its file" "$(json_get "$STORE/targets/vm1.json" 'j["ram"]')" $((512 << 20))
assert_eq "vm1 overflow_max" "$(json_get "$STORE/targets/vm1.json" 'j["overflow_max"]')" $((2 << 30))
ls -A "$STORE/targets" | grep -q tmp && fail "a temporary file was left in $STORE/targets"

vds target list --json >"$E2E_TMP/list.json"
assert_eq "listed ids" "$(json_get "$E2E_TMP/list.json" '[t["id"] for t in j]')" "['vm1', 'vm2']"
grep -Eq '^vm1 +win +production +ram-overflow +512 MiB +2 GiB +- +lab PC 1$' <<<"$(vds target list)" || fail "list text: $(vds target list)"
grep -q "cache:    ram-overflow (RAM 512 MiB, file up to 2 GiB)" <<<"$(vds target show vm1)" || fail "show text: $(vds target show vm1)"
vds target show vm1 --json >"$E2E_TMP/show.json"
assert_eq "show --json is the record" "$(json_get "$E2E_TMP/show.json" "j == json.load(open('$STORE/targets/vm1.json'))")" True

# set: patch semantics; a type without RAM drops the RAM size; an empty description clears it.
vds target set vm1 --cache device-disk --description "" --json >"$E2E_TMP/set.json"
assert_eq "after set" "$(json_get "$E2E_TMP/set.json" '(j["cache"], j.get("ram"), j["overflow_max"], j.get("description"), j["generation"])')" \
    "('device-disk', None, 2147483648, None, 2)"
vds target set vm1 --vdisk lin --version latest >/dev/null
assert_eq "moved" "$(vds target show vm1 --json | json_get /dev/stdin '(j["vdisk"], j["version"])')" "('lin', 'latest')"

# Refusals change nothing.
cp "$STORE/targets/vm2.json" "$E2E_TMP/vm2.before"
expect_error "bad id" "invalid target id" vds target add ../x --vdisk win --cache server
expect_error "unknown vDisk" 'no vDisk named "nope".*known vDisks: lin, win' vds target add vm4 --vdisk nope --cache server
expect_error "unknown cache type" "a similar value exists: 'ram-overflow'" vds target add vm4 --vdisk win --cache ram
expect_error "private" "cannot have the private cache type" vds target add vm4 --vdisk win --cache private
expect_error "--ram on server" "--ram is for the device-ram and ram-overflow" vds target add vm4 --vdisk win --cache server --ram 1G
expect_error "maintenance" "cannot boot the maintenance version" vds target add vm4 --vdisk win --cache server --version maintenance
expect_error "bad size" "unknown unit" vds target add vm4 --vdisk win --cache device-ram --ram 12parsecs
expect_error "second add" "target vm2 already exists" vds target add vm2 --vdisk lin --cache server
expect_error "unknown target" 'no target named "vm9".*known targets: vm1, vm2' vds target show vm9
expect_error "set nothing" "nothing to set" vds target set vm2
expect_error "set to a missing vDisk" 'no vDisk named "gone"' vds target set vm2 --vdisk gone
cmp "$STORE/targets/vm2.json" "$E2E_TMP/vm2.before" || fail "a refused change altered vm2's record"
[[ ! -e $STORE/targets/vm4.json ]] || fail "a refused add left a record"

# A vDisk that targets boot cannot be deleted.
expect_error "delete a booted vDisk" "vDisk win is booted by targets vm2.*target remove" vds vdisk delete win
vds target remove vm2 --json >"$E2E_TMP/rm.json"
assert_eq "removed" "$(json_get "$E2E_TMP/rm.json" 'j["removed"]')" vm2
vds vdisk delete win >/dev/null || fail "win has no targets left, yet delete failed"
expect_error "delete lin" "booted by targets vm1" vds vdisk delete lin

# Every change is in the audit trail, under the vDisk the record names.
vds audit --json >"$E2E_TMP/audit.json"
assert_eq "target actions" "$(json_get "$E2E_TMP/audit.json" '[(e["action"], e["details"]["target"]) for e in j if e["action"].startswith("target.")]')" \
    "[('target.add', 'vm1'), ('target.add', 'vm2'), ('target.set', 'vm1'), ('target.set', 'vm1'), ('target.remove', 'vm2')]"
log "ok: target records"
