#!/usr/bin/env bash
# Many requests in flight on one connection: 64 outstanding aio_pwrite of distinct
# random 64 KiB blocks (some FUA, if offered), then 64 outstanding aio_pread of the same blocks in a
# shuffled order; every command completes without error and every block reads back
# exactly; libnbd's in-flight count really reached 64.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdsh
require_python_nbd
e2e_init

start_server --memory 64M
nbdsh_script "
import os, random
N, BS = 64, 65536
blocks = [os.urandom(BS) for _ in range(N)]
slots = random.sample(range(1024), N)        # 64 of the 1024 64K slots in the disk
cookies = []
for i in range(N):
    buf = nbd.Buffer.from_bytearray(bytearray(blocks[i]))
    flags = nbd.CMD_FLAG_FUA if i % 8 == 0 and h.can_fua() else 0
    cookies.append(h.aio_pwrite(buf, slots[i] * BS, flags=flags))
peak = h.aio_in_flight()
for c in cookies:
    while not h.aio_command_completed(c):
        h.poll(-1)
print('writes in flight at peak:', peak)

order = list(range(N)); random.shuffle(order)
reads = {}
for i in order:
    b = nbd.Buffer(BS)
    reads[i] = (b, h.aio_pread(b, slots[i] * BS))
peak_r = h.aio_in_flight()
for i, (b, c) in reads.items():
    while not h.aio_command_completed(c):
        h.poll(-1)
    assert b.to_bytearray() == blocks[i], f'block {i} at slot {slots[i]} read back wrong'
print('reads in flight at peak:', peak_r)
assert max(peak, peak_r) >= N - 1, f'only {max(peak, peak_r)} commands were in flight'
"
