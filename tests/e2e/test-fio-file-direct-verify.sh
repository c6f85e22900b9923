#!/usr/bin/env bash
# Same as test-fio-file-verify but the export is served with --direct (O_DIRECT on the
# backing file), with unaligned-to-the-page writes ruled out by fio's 4k blocks and a
# randrw mix: exit 0, no verify errors. Skips if the scratch file system has no O_DIRECT.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=fio-verify.sh
source "$E2E_DIR/fio-verify.sh"
require fio
require_python_nbd
e2e_init

img=$E2E_TMP/disk.img
truncate -s 128M "$img"
"$PY" -c 'import os,sys; os.close(os.open(sys.argv[1], os.O_RDWR | os.O_DIRECT))' "$img" 2>/dev/null ||
    skip "file system of $E2E_TMP does not support O_DIRECT"
start_server --direct "$img"
run_fio_verify direct --rw=randwrite --bs=4k --size=48m --iodepth=16 \
    --numjobs=2 --offset_increment=64m --group_reporting=0
run_fio_verify direct-rw --rw=randrw --rwmixwrite=80 --bs=4k --size=32m --iodepth=16
