#!/usr/bin/env bash
# fio's nbd engine against a file-backed export: random 4 KiB writes (two jobs, QD 16)
# with crc32c verify; afterwards the backing file holds the data fio wrote (checked by
# comparing it with a read of the export through qemu-img compare).
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=fio-verify.sh
source "$E2E_DIR/fio-verify.sh"
require fio qemu-img
require_python_nbd
e2e_init

img=$E2E_TMP/disk.img
truncate -s 128M "$img"
start_server "$img"
run_fio_verify file --rw=randwrite --bs=4k --size=48m --iodepth=16 \
    --numjobs=2 --offset_increment=64m --group_reporting=0
nbdsh_script 'h.flush()'
run_bounded 120 qemu-img compare -f raw -F raw "$img" "$URI" || fail "file differs from what the export serves"
[[ $(du -k "$img" | cut -f1) -gt 8192 ]] || fail "backing file did not receive the writes"
