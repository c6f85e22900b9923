#!/usr/bin/env bash
# Requests longer than the advertised maximum block size (32 MiB), sent with libnbd's
# strict mode off: a 64 MiB read fails with EINVAL (or the server drops the connection)
# without the server falling over; an oversized write is refused the same way; a new
# connection afterwards works. Also a read of exactly the maximum works.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdsh
require_python_nbd
e2e_init

start_server --memory 128M
nbdsh_script "
import errno
MiB = 1 << 20
maxb = h.get_block_size(nbd.SIZE_MAXIMUM)
assert maxb == 32 * MiB, f'block_size_maximum {maxb}'
assert len(h.pread(maxb, 0)) == maxb, 'read of exactly the maximum failed'
h.set_strict_mode(0)
for what, f in [('64 MiB read', lambda: h.pread(64 * MiB, 0)),
                ('32 MiB + 1 write', lambda: h.pwrite(b'z' * (32 * MiB + 1), 0))]:
    try:
        f()
    except nbd.Error as e:
        if e.errnum == errno.EINVAL:
            print(f'{what}: EINVAL ok')
            continue
        # The spec lets a server hang up instead of answering an oversized request.
        assert h.aio_is_closed() or h.aio_is_dead(), f'{what}: got {e.errno} ({e.string}), want EINVAL or disconnect'
        print(f'{what}: server disconnected ({e.string})')
        break
    else:
        raise AssertionError(f'{what}: succeeded, bigger than the advertised maximum')
if not (h.aio_is_closed() or h.aio_is_dead()):
    assert h.pread(4096, 0) == bytes(4096), 'connection unusable after refused request'
"
assert_eq "new connection after oversized requests" "$(nbdinfo --size "$URI")" $((128 * 1024 * 1024))
