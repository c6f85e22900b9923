#!/usr/bin/env bash
# fio's nbd engine, mixed random reads/writes (70% writes, mixed 4k-64k blocks, queue
# depth 32) to a --memory export with crc32c verification of everything written, and a
# second pass of sequential 1 MiB writes+verify: exit 0, no verify errors.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=fio-verify.sh
source "$E2E_DIR/fio-verify.sh"
require fio
require_python_nbd
e2e_init

start_server --memory 128M
run_fio_verify randrw --rw=randrw --rwmixwrite=70 --bsrange=4k-64k --size=48m --iodepth=32
run_fio_verify seqwrite --rw=write --bs=1m --size=96m --iodepth=4
