#!/usr/bin/env bash
# nbdinfo reports the export size: a --memory disk of 1G and 64M, and a raw file whose
# size is not a multiple of 1 MiB (the file's exact byte length).
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdinfo
e2e_init

start_server --memory 1G
assert_eq "size of --memory 1G" "$(nbdinfo --size "$URI")" 1073741824

start_server --memory 64M
assert_eq "size of --memory 64M" "$(nbdinfo --size "$URI")" 67108864

truncate -s $((10 * 1024 * 1024 + 4096 * 3)) "$E2E_TMP/disk.img"
start_server "$E2E_TMP/disk.img"
assert_eq "size of a raw file" "$(nbdinfo --size "$URI")" $((10 * 1024 * 1024 + 4096 * 3))
