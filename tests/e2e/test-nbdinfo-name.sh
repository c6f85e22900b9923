#!/usr/bin/env bash
# Export names: with --name golden the export answers both to "golden" and to the
# default name "", an unknown name is refused, and `nbdinfo --list` lists "golden". A server without --name
# answers to "" and lists exactly one export, whose listed name also connects.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdinfo
require_python_nbd
e2e_init

start_server --memory 16M --name golden
sock=$SOCK
nbdinfo --json "nbd+unix:///golden?socket=$sock" >"$E2E_TMP/named.json"
assert_eq "export-name via /golden" "$(json_get "$E2E_TMP/named.json" 'j["exports"][0]["export-name"]')" golden
assert_eq "size via /golden" "$(nbdinfo --size "nbd+unix:///golden?socket=$sock")" $((16 * 1024 * 1024))
assert_eq "size via default name" "$(nbdinfo --size "nbd+unix:///?socket=$sock")" $((16 * 1024 * 1024))

nbdinfo --list --json "nbd+unix:///?socket=$sock" >"$E2E_TMP/list.json"
cat "$E2E_TMP/list.json" >&2
assert_eq "--list contains golden" \
    "$(json_get "$E2E_TMP/list.json" '"golden" in [e["export-name"] for e in j["exports"]]')" True

start_server --memory 16M
nbdinfo --list --json "$URI" >"$E2E_TMP/list2.json"
cat "$E2E_TMP/list2.json" >&2
assert_eq "--list without --name has one export" "$(json_get "$E2E_TMP/list2.json" 'len(j["exports"])')" 1
# Whatever name the server lists must be one a client can connect with.
listed=$(json_get "$E2E_TMP/list2.json" 'j["exports"][0]["export-name"]')
assert_eq "size via the listed name '$listed'" "$(nbdinfo --size "nbd+unix:///$listed?socket=$SOCK")" $((16 * 1024 * 1024))

# The server serves exactly one export: a name it does not know is refused.
if timeout 10 nbdinfo --size "nbd+unix:///no-such-vdisk?socket=$sock" >"$E2E_TMP/unknown.out" 2>&1; then
    fail "an unknown export name was accepted: $(cat "$E2E_TMP/unknown.out")"
fi
log "ok: unknown export name refused: $(tail -n1 "$E2E_TMP/unknown.out")"
