#!/usr/bin/env bash
# A file served with --read-only is reported read-only by nbdinfo, does not offer
# trim or write-zeroes, and still reports the file's size.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdinfo
require_python_nbd
e2e_init

truncate -s 32M "$E2E_TMP/golden.img"
start_server --read-only "$E2E_TMP/golden.img"
nbdinfo --json "$URI" >"$E2E_TMP/info.json"
cat "$E2E_TMP/info.json" >&2

ex='j["exports"][0]'
assert_eq is_read_only "$(json_get "$E2E_TMP/info.json" "${ex}['is_read_only']")" True
assert_eq can_trim "$(json_get "$E2E_TMP/info.json" "$ex.get('can_trim')")" False
assert_eq can_zero "$(json_get "$E2E_TMP/info.json" "$ex.get('can_zero')")" False
assert_eq export-size "$(json_get "$E2E_TMP/info.json" "${ex}['export-size']")" $((32 * 1024 * 1024))
