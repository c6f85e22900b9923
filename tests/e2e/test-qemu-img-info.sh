#!/usr/bin/env bash
# qemu-img info on the NBD URI reports format raw and the export's virtual size, for a
# --memory export and for a named file-backed export reached by its name.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require qemu-img
require_python_nbd
e2e_init

start_server --memory 96M
run_bounded 60 qemu-img info --output=json "$URI" >"$E2E_TMP/info.json" || fail "qemu-img info failed"
cat "$E2E_TMP/info.json" >&2
assert_eq "virtual-size" "$(json_get "$E2E_TMP/info.json" 'j["virtual-size"]')" $((96 * 1024 * 1024))
assert_eq "format" "$(json_get "$E2E_TMP/info.json" 'j["format"]')" raw

truncate -s 20M "$E2E_TMP/win10.img"
start_server --name win10 "$E2E_TMP/win10.img"
run_bounded 60 qemu-img info --output=json "nbd+unix:///win10?socket=$SOCK" >"$E2E_TMP/info2.json" || fail "qemu-img info (named) failed"
assert_eq "virtual-size of named export" "$(json_get "$E2E_TMP/info2.json" 'j["virtual-size"]')" $((20 * 1024 * 1024))
