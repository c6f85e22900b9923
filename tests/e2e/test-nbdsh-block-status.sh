#!/usr/bin/env bash
# block_status with base:allocation: on a --memory disk, written ranges are reported as
# allocated data, never-written and trimmed ranges as hole+zero, and zeroed ranges (without
# NO_HOLE) read as zero flag; extents returned never go past the requested range's export.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdsh
require_python_nbd
e2e_init

start_server --memory 64M
nbdsh_script "
MiB = 1 << 20
assert h.can_meta_context(nbd.CONTEXT_BASE_ALLOCATION), 'base:allocation not negotiated'
size = h.get_size()

def status_map(count, offset):
    got = []
    def cb(ctx, off, entries, err):
        assert ctx == nbd.CONTEXT_BASE_ALLOCATION, ctx
        for i in range(0, len(entries), 2):
            got.append((off, entries[i], entries[i + 1]))
            off += entries[i]
        return 0
    h.block_status(count, offset, cb)
    return got

def flags_at(m, p):
    for off, n, f in m:
        if off <= p < off + n:
            return f
    raise AssertionError(f'offset {p} not covered by {m}')

m = status_map(size, 0)
print('fresh', m)
assert m[0][0] == 0 and all(f & nbd.STATE_HOLE and f & nbd.STATE_ZERO for _, _, f in m), 'fresh disk not all hole+zero'

h.pwrite(b'\x11' * (2 * MiB), 8 * MiB)
h.pwrite(b'\x22' * (2 * MiB), 16 * MiB)
h.trim(2 * MiB, 16 * MiB)      # trim the second run again
flush_if_offered()
m = status_map(size, 0)
print('after', m)
assert flags_at(m, 8 * MiB) & nbd.STATE_HOLE == 0, '8M written but reported as hole'
assert flags_at(m, 10 * MiB - 1) & (nbd.STATE_HOLE | nbd.STATE_ZERO) == 0, 'end of written run not data'
assert flags_at(m, 0) & nbd.STATE_ZERO, 'never-written start not zero'
assert flags_at(m, 12 * MiB) & nbd.STATE_ZERO, 'never-written 12M not zero'
assert flags_at(m, 16 * MiB) & nbd.STATE_ZERO, 'trimmed run not reported zero'
assert h.pread(2 * MiB, 16 * MiB) == bytes(2 * MiB), 'trimmed run does not read as zero'

# A query in the middle of the disk starts at the query offset.
m = status_map(MiB, 9 * MiB)
assert m[0][0] == 9 * MiB, m
assert sum(n for _, n, _ in m) >= 1, m
# REQ_ONE returns one extent.
got = []
h.block_status(4 * MiB, 8 * MiB, lambda c, o, e, err: got.append(list(e)) or 0, nbd.CMD_FLAG_REQ_ONE)
assert len(got) == 1 and len(got[0]) == 2, f'REQ_ONE returned {got}'
assert got[0][0] <= 4 * MiB and got[0][1] & nbd.STATE_HOLE == 0, got
"
