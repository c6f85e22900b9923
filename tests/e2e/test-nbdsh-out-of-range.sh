#!/usr/bin/env bash
# Requests past the end of the export (libnbd strict mode off, so they reach the server)
# fail with the errno doc/proto.md asks for: reads, trims, cache and block status EINVAL,
# writes ENOSPC (write-zeroes ENOSPC or EINVAL); offsets whose end overflows 64 bits are
# refused too; and the connection keeps working afterwards.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdsh
require_python_nbd
e2e_init

start_server --memory 8M
nbdsh_script "
import errno
h.set_strict_mode(0)
size = h.get_size()
assert size == 8 << 20
names = {errno.EINVAL: 'EINVAL', errno.ENOSPC: 'ENOSPC'}

def expect(want, what, f):
    try:
        f()
    except nbd.Error as e:
        assert e.errnum in want, f'{what}: got {e.errno} ({e.string}), want {[names[w] for w in want]}'
        print(f'{what}: {e.errno} ok')
        return
    raise AssertionError(f'{what}: succeeded past the end of the export')

EINVAL, ENOSPC = [errno.EINVAL], [errno.ENOSPC]
expect(EINVAL, 'read straddling end', lambda: h.pread(8192, size - 4096))
expect(EINVAL, 'read at end', lambda: h.pread(1, size))
expect(EINVAL, 'read far past end', lambda: h.pread(4096, 1 << 40))
expect(EINVAL, 'read with offset+count overflowing u64', lambda: h.pread(4096, (1 << 64) - 2048))
expect(ENOSPC, 'write straddling end', lambda: h.pwrite(b'x' * 8192, size - 4096))
expect(ENOSPC, 'write at end', lambda: h.pwrite(b'x', size))
expect(ENOSPC + EINVAL, 'write with offset+count overflowing u64', lambda: h.pwrite(b'x' * 4096, (1 << 64) - 2048))
expect(EINVAL, 'trim straddling end', lambda: h.trim(8192, size - 4096))
expect(ENOSPC + EINVAL, 'zero straddling end', lambda: h.zero(8192, size - 4096))
if h.can_cache():
    expect(EINVAL, 'cache straddling end', lambda: h.cache(8192, size - 4096))
expect(EINVAL, 'block status at end', lambda: h.block_status(4096, size, lambda *a: 0))

# Nothing was written by the failed requests, and the connection still works.
assert h.pread(4096, size - 4096) == bytes(4096), 'a refused write changed the last block'
h.pwrite(b'y' * 4096, size - 4096)
assert h.pread(4096, size - 4096) == b'y' * 4096
"
