#!/usr/bin/env bash
# Write-zeroes: zero (plain, with NO_HOLE, and with FAST_ZERO) turns written data into
# zeros, leaves bytes outside the range alone, and is accepted at unaligned offsets.
# FAST_ZERO either succeeds or fails with ENOTSUP (the spec's only allowed error) and
# then leaves the data untouched.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdsh
require_python_nbd
e2e_init

start_server --memory 64M
nbdsh_script "
import errno, os
MiB = 1 << 20
assert h.can_zero(), 'can_zero false'
pattern = os.urandom(8 * MiB)
h.pwrite(pattern, 0)

h.zero(MiB, MiB)                                   # plain: may punch a hole
h.zero(MiB, 3 * MiB, nbd.CMD_FLAG_NO_HOLE)          # must allocate zeros
h.zero(4097, 5 * MiB + 3)                          # unaligned both ends
buf = h.pread(8 * MiB, 0)
exp = bytearray(pattern)
exp[MiB:2 * MiB] = bytes(MiB)
exp[3 * MiB:4 * MiB] = bytes(MiB)
exp[5 * MiB + 3:5 * MiB + 3 + 4097] = bytes(4097)
assert buf == bytes(exp), 'zero did not zero exactly the requested ranges'

if h.can_fast_zero():
    h.pwrite(pattern[:MiB], 6 * MiB)
    try:
        h.zero(MiB, 6 * MiB, nbd.CMD_FLAG_FAST_ZERO)
        assert h.pread(MiB, 6 * MiB) == bytes(MiB), 'FAST_ZERO succeeded but data not zero'
        print('fast zero: done')
    except nbd.Error as e:
        assert e.errnum == errno.ENOTSUP, f'FAST_ZERO failed with {e.errno}, spec allows only ENOTSUP'
        assert h.pread(MiB, 6 * MiB) == pattern[:MiB], 'failed FAST_ZERO changed data'
        print('fast zero: ENOTSUP')
else:
    print('server does not advertise fast zero')
"
