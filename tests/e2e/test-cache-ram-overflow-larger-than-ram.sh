#!/usr/bin/env bash
# ram-overflow with a working set larger than its RAM: `--cache ram-overflow --ram 16M`
# over a 128 MiB base, fio's nbd engine writes 80 MiB (random 4k-64k, QD 16, two jobs) and
# verifies every block with crc32c, then a mixed random read/write pass re-verifies — exit
# 0, no verify errors, so data evicted to the overflow file reads back intact. While the
# server runs, its overflow file (unlinked at creation, so only visible under
# /proc/PID/fd) holds data: the run did overflow. The base file is unchanged afterwards,
# and unwritten areas of the export still read as the base.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=fio-verify.sh
source "$E2E_DIR/fio-verify.sh"
require fio cmp nbdsh
require_python_nbd
require_vdstream
e2e_init

base=$E2E_TMP/base.img
make_sparse_image "$base" 128
dd if=/dev/urandom of="$base" bs=1M seek=100 count=8 conv=notrunc status=none   # never written by fio
cp --sparse=always "$base" "$E2E_TMP/base.pristine"
dir=$E2E_TMP/overflow
mkdir "$dir"

start_server "$base" --cache ram-overflow --ram 16M --overflow-dir "$dir"
# Job 1 covers [0, 40M), job 2 [40M, 80M): 80 MiB written, 5x the RAM.
run_fio_verify bigwrite --rw=randwrite --bsrange=4k-64k --size=40m --iodepth=16 \
    --numjobs=2 --offset_increment=40m --group_reporting=0
server_alive "$SERVER_PID" || fail "server died during the write pass"

# Bytes allocated in the server's overflow file(s): deleted files open under the dir.
overflow_bytes() {
    local fd target total=0 blocks
    for fd in /proc/"$SERVER_PID"/fd/*; do
        target=$(readlink "$fd" 2>/dev/null) || continue
        [[ $target == "$dir"/* ]] || continue
        blocks=$(stat -L -c %b "$fd" 2>/dev/null) || continue
        total=$((total + blocks * 512))
    done
    echo "$total"
}
used=$(overflow_bytes)
log "overflow file(s) under $dir hold $((used >> 20)) MiB"
((used >= 32 << 20)) || fail "overflow file holds only $used bytes after writing 80 MiB with 16 MiB of RAM"
[[ -z $(ls -A "$dir") ]] || fail "overflow dir has a visible entry (the file should be unlinked): $(ls -A "$dir")"

# A second, mixed pass over the same 80 MiB, re-verifying (reads hit RAM and the file).
run_fio_verify mixed --rw=randrw --rwmixwrite=50 --bsrange=4k-64k --size=80m --iodepth=16
nbdsh_script "
base = open('$base', 'rb')
base.seek(100 << 20)
assert h.pread(8 << 20, 100 << 20) == base.read(8 << 20), 'unwritten area does not read as the base'
"
log "ok: unwritten area reads as the base"
server_alive "$SERVER_PID" || fail "server died"
rc=0
stop_server "$SERVER_PID" 15 || rc=$?
assert_eq "server exit status" "$rc" 0
cmp "$base" "$E2E_TMP/base.pristine" || fail "the base file was modified"
log "ok: base file unchanged"
