#!/usr/bin/env bash
# Two processes change one vDisk's metadata at the same time (`vdisk set` and
# `version new`/`promote`/`revert` loops, bounded). Afterwards vdisk.json loads and passes
# its checks, every successful command is in the audit trail exactly once, and the
# versions listed are exactly the files on disk. (Each command is its own process: 1
# create + 40 sets + 10 new + 10 promote/revert = 61 pids.)
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
require qemu-img
require_vdstream
e2e_init
store_init

vds vdisk create c --size 16M --max-versions 100 >/dev/null
setter() {
    local i ok=0
    for ((i = 0; i < 40; i++)); do
        vds vdisk set c --max-versions $((50 + i)) >/dev/null && ok=$((ok + 1))
    done
    echo "$ok" >"$E2E_TMP/set.ok"
}
versioner() {
    local i v ok=0
    for ((i = 0; i < 10; i++)); do
        v=$(vds version new c --json | json_get /dev/stdin 'j["version"]["number"]') || continue
        ok=$((ok + 1))
        if ((i % 3 == 2)); then vds version revert c "$v" >/dev/null; else vds version promote c "$v" --to test >/dev/null; fi
    done
    echo "$ok" >"$E2E_TMP/new.ok"
}
run_bounded 60 bash -c "$(declare -f vds setter json_get); STORE=$STORE VDSTREAM_BIN=$VDSTREAM_BIN E2E_TMP=$E2E_TMP PY=$PY; setter" &
a=$!
run_bounded 60 bash -c "$(declare -f vds versioner json_get); STORE=$STORE VDSTREAM_BIN=$VDSTREAM_BIN E2E_TMP=$E2E_TMP PY=$PY; versioner" &
b=$!
wait "$a" || fail "the setter loop failed"
wait "$b" || fail "the version loop failed"
assert_eq "successful sets" "$(cat "$E2E_TMP/set.ok")" 40
assert_eq "successful new versions" "$(cat "$E2E_TMP/new.ok")" 10

vds vdisk info c --json >"$E2E_TMP/info.json" || fail "vdisk.json does not load after concurrent updates"
vds audit c --json >"$E2E_TMP/audit.json"
count() { json_get "$E2E_TMP/audit.json" "sum(1 for e in j if e['action'] == '$1')"; }
assert_eq "vdisk.set entries" "$(count vdisk.set)" 40
assert_eq "version.new entries" "$(count version.new)" 10
assert_eq "revert + promote entries" "$(($(count version.revert) + $(count version.promote)))" 10
assert_eq "pids in the audit" "$(json_get "$E2E_TMP/audit.json" "len(set(e['pid'] for e in j))")" 61
listed=$(json_get "$E2E_TMP/info.json" '" ".join(sorted(v["file"] for v in j["meta"]["versions"]))')
ondisk=$(cd "$STORE/vdisks/c" && ls c.[0-9]*.qcow2 | sort | tr '\n' ' ' | sed 's/ $//')
assert_eq "version files on disk" "$ondisk" "$listed"
assert_eq "max_versions is the setter's last" "$(json_get "$E2E_TMP/info.json" 'j["meta"]["max_versions"]')" 89
