#!/usr/bin/env bash
# `vdstream … --server URL` against a running API prints what the command prints on the
# store itself, byte for byte, with --json and without: vdisk list/show, version list,
# target list/show; mutations through the API (target add/set/remove, version
# new/promote/revert) land in the store and its audit trail, as the local commands'
# would, with the API client's address (ip:port) in each audit entry; errors read the same; an unreachable server or a bad URL is named.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
source "$(dirname "$0")/api-lib.sh"
require curl
require_vdstream
e2e_init
store_init

vds vdisk create win --size 16M >/dev/null
vds vdisk create lin --size 16M >/dev/null
vds target add vm1 --vdisk win --cache ram-overflow --ram 512M --description "lab PC 1" >/dev/null
start_api

# same_output WHAT ARGS... — the command prints the same locally and through the API.
same_output() {
    local what=$1; shift
    vds "$@" >"$E2E_TMP/local.out" 2>&1 || fail "$what: local command failed: $(cat "$E2E_TMP/local.out")"
    vds "$@" --server "$API_URL" >"$E2E_TMP/remote.out" 2>&1 || fail "$what: --server failed: $(cat "$E2E_TMP/remote.out")"
    diff -u "$E2E_TMP/local.out" "$E2E_TMP/remote.out" >&2 || fail "$what: --server prints something else"
    log "ok: $what prints the same through the API"
}

for j in "" --json; do
    same_output "vdisk show $j" vdisk show win $j
    same_output "version list $j" version list win $j
    same_output "target list $j" target list $j
    same_output "target show $j" target show vm1 $j
done
same_output "vdisk list --json" vdisk list --json
grep -Eq '^win +16 MiB +standard' <<<"$(vds vdisk list --server "$API_URL")" || fail "vdisk list through the API: $(vds vdisk list --server "$API_URL")"

# Mutations through the API.
out=$(vds target add vm2 --vdisk lin --cache device-ram --ram 64M --server "$API_URL")
grep -q "added target vm2: vDisk lin" <<<"$out" || fail "target add --server said: $out"
assert_eq "vm2 in the store" "$(json_get "$STORE/targets/vm2.json" '(j["cache"], j["ram"])')" "('device-ram', 67108864)"
vds target set vm2 --version latest --description "" --server "$API_URL" --json >"$E2E_TMP/set.json"
assert_eq "set through the API" "$(json_get "$E2E_TMP/set.json" '(j["version"], j["generation"])')" "('latest', 2)"
v=$(vds version new win --note "via API" --server "$API_URL" --json | json_get /dev/stdin 'j["version"]["number"]')
assert_eq "new version" "$v" 1
grep -q "version 1 of win is now test" <<<"$(vds version promote win 1 --to test --server "$API_URL")" || fail "promote --server"
grep -q "is now production from" <<<"$(vds version promote win 1 --to production --at +1h --server "$API_URL")" || fail "promote --at --server"
grep -q "version 1 of win is back in test" <<<"$(vds version revert win 1 --server "$API_URL")" || fail "revert --server"
assert_eq "version 1 in the store" "$(vds version list win --json | json_get /dev/stdin '[(v["number"], v["access"], v["note"]) for v in j["versions"]]')" "[(1, 'test', 'via API')]"
grep -q "removed target vm2" <<<"$(vds target remove vm2 --server "$API_URL")" || fail "remove --server"
[[ ! -e $STORE/targets/vm2.json ]] || fail "vm2's record is still there"
vds audit --json >"$E2E_TMP/audit.json"
assert_eq "audited" "$(json_get "$E2E_TMP/audit.json" '[e["action"] for e in j][-7:]')" \
    "['target.add', 'target.set', 'version.new', 'version.promote', 'version.promote', 'version.revert', 'target.remove']"
# Each change through the API names its client's address; a local change names none.
assert_eq "API clients audited" "$(json_get "$E2E_TMP/audit.json" 'sorted({e.get("client", "").rsplit(":", 1)[0] for e in j[-7:]})')" "['127.0.0.1']"
assert_eq "local change without client" "$(json_get "$E2E_TMP/audit.json" '"client" in j[0]')" "False"
vds audit --limit 1 >"$E2E_TMP/audit.txt"
grep -Eq 'via API from 127\.0\.0\.1:[0-9]+\)' "$E2E_TMP/audit.txt" || fail "vdstream audit does not show the API client: $(cat "$E2E_TMP/audit.txt")"
log "ok: changes through the API are audited with the client's address"

# Errors read the same, locally and through the API.
for args in "vdisk show nope" "target show nope" "version promote win 7 --to test" "target add vm1 --vdisk win --cache server" "target add x --vdisk win --cache private" "vdisk show a..b" "target set vm1 --cache server --ram 1G"; do
    # shellcheck disable=SC2086
    vds $args >/dev/null 2>"$E2E_TMP/local.err" && fail "$args succeeded locally"
    # shellcheck disable=SC2086
    vds $args --server "$API_URL" >/dev/null 2>"$E2E_TMP/remote.err" && fail "$args succeeded through the API"
    diff -u "$E2E_TMP/local.err" "$E2E_TMP/remote.err" >&2 || fail "$args: the API's error reads differently"
    log "ok: '$args' is refused with the same words: $(head -c 120 "$E2E_TMP/local.err")"
done

# Where the API is not.
vds vdisk list --server http://127.0.0.1:1 2>"$E2E_TMP/err" && fail "a closed port answered"
grep -q "cannot connect to the vdstream server at http://127.0.0.1:1" "$E2E_TMP/err" || fail "unreachable: $(cat "$E2E_TMP/err")"
vds vdisk list --server 127.0.0.1:8480 2>"$E2E_TMP/err" && fail "a URL without http:// was taken"
grep -q "give http://HOST:PORT" "$E2E_TMP/err" || fail "bad URL: $(cat "$E2E_TMP/err")"
log "ok: the CLI through the API"
