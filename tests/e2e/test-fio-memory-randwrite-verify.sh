#!/usr/bin/env bash
# fio's nbd engine, 4 KiB random writes at queue depth 16 from two jobs (each on its own
# 64 MiB region) to a --memory export, then fio reads every block back and checks its
# crc32c: exit 0, no verify errors.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=fio-verify.sh
source "$E2E_DIR/fio-verify.sh"
require fio
require_python_nbd
e2e_init

start_server --memory 256M
run_fio_verify randwrite --rw=randwrite --bs=4k --size=64m --iodepth=16 \
    --numjobs=2 --offset_increment=64m --group_reporting=0
