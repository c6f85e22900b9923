#!/usr/bin/env bash
# Structured replies: libnbd negotiates them, and pread_structured over a range that
# mixes written data and never-written space gets chunks that exactly tile the range,
# data chunks carrying the written bytes, hole chunks only where nothing was written
# (vdstream must send at least one OFFSET_HOLE chunk there; nbdkit never does). Checked on
# a RAM disk and on a sparse raw file, whose holes vdstream finds with SEEK_HOLE.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdsh
require_python_nbd
e2e_init

expect_hole=0
if is_vdstream; then expect_hole=1; fi

check_structured_read() {
nbdsh_script "
import os
expect_hole = $expect_hole
assert h.get_structured_replies_negotiated(), 'structured replies not negotiated'
MiB = 1 << 20
data = os.urandom(MiB)
h.pwrite(data, 2 * MiB)            # data at [2M, 3M); [0, 2M) and [3M, 4M) never written
flush_if_offered()

chunks = []
def cb(subbuf, offset, status, err):
    chunks.append((offset, len(subbuf), status, bytes(subbuf)))
    return 0
buf = h.pread_structured(4 * MiB, 0, cb)
assert buf[:2 * MiB] == bytes(2 * MiB), 'unwritten head not zero'
assert buf[2 * MiB:3 * MiB] == data, 'written data does not read back'
assert buf[3 * MiB:] == bytes(MiB), 'unwritten tail not zero'

chunks.sort()
pos = 0
holes = 0
for off, n, status, b in chunks:
    assert off == pos, f'chunks do not tile the read: gap/overlap at {pos}, next chunk at {off}'
    pos += n
    if status == nbd.READ_HOLE:
        holes += 1
        assert off + n <= 2 * MiB or off >= 3 * MiB, f'hole chunk {off}+{n} overlaps written data'
        assert b == bytes(n), 'hole chunk buffer not zero'
    elif status == nbd.READ_DATA:
        want = bytes(data[max(0, off - 2 * MiB):max(0, off + n - 2 * MiB)]) if off < 3 * MiB and off + n > 2 * MiB else None
        if want is not None and off >= 2 * MiB and off + n <= 3 * MiB:
            assert b == want, f'data chunk at {off} has wrong bytes'
    else:
        raise AssertionError(f'unexpected chunk status {status}')
assert pos == 4 * MiB, f'chunks cover {pos} bytes, read was {4 * MiB}'
print(f'{len(chunks)} chunks, {holes} holes')
if expect_hole:
    assert holes > 0, 'no OFFSET_HOLE chunk over 3 MiB of never-written space'
"
}

start_server --memory 64M
check_structured_read
stop_server

truncate -s 64M "$E2E_TMP/sparse.img"
start_server "$E2E_TMP/sparse.img"
check_structured_read
stop_server
