#!/usr/bin/env bash
# device-ram answers ENOSPC when its RAM is full, and nothing else breaks:
# `--cache device-ram --ram 1M` over a 16 MiB base; nbdsh writes new 4 KiB pages (every
# other page, random contents) until one fails. The failure is nbd.Error with errno
# ENOSPC (.errnum == errno.ENOSPC; libnbd's .errno is the name 'ENOSPC') (not EIO, not a dropped connection), it comes after at least 1 MiB and well
# before 16 MiB; every page written before it reads back; an overwrite of a written page
# still succeeds; pages never written read as the base's bytes; the server is alive and
# answers a new connection; a TRIM of written pages gives RAM back (they read as zeros)
# and new writes succeed again. The base file is unchanged.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdsh nbdinfo cmp
require_python_nbd
require_vdstream
e2e_init

base=$E2E_TMP/base.img
make_sparse_image "$base" 16
dd if=/dev/urandom of="$base" bs=1M seek=2 count=2 conv=notrunc status=none
cp --sparse=always "$base" "$E2E_TMP/base.pristine"

start_server "$base" --cache device-ram --ram 1M --overflow-dir "$E2E_TMP"
nbdsh_script "
import errno, os, nbd
PAGE, MiB = 4096, 1 << 20
base = open('$base', 'rb').read()
size = h.get_size()
assert size == len(base) == 16 * MiB, size

written = {}                     # offset -> bytes
err = None
for off in range(0, size, 2 * PAGE):          # every other page: unwritten neighbours
    data = os.urandom(PAGE)
    try:
        h.pwrite(data, off)
    except nbd.Error as e:
        err, failed_at = e, off
        break
    written[off] = data
assert err is not None, 'no write failed: 16 MiB of new pages fitted in --ram 1M'
# libnbd: .errnum is the number, .errno its name.
print(f'write {len(written) + 1} (offset {failed_at}) failed: {err} (errnum {err.errnum})')
assert err.errnum == errno.ENOSPC and err.errno == 'ENOSPC', f'want ENOSPC, got {err.errno} ({err.errnum}): {err}'
assert len(written) * PAGE >= MiB - 64 * 1024, f'ENOSPC after only {len(written)} pages'
assert h.aio_in_flight() == 0

# The failed write changed nothing: its page still reads as the base.
assert h.pread(PAGE, failed_at) == base[failed_at:failed_at + PAGE], 'failed write left data behind'
# A second new-page write fails the same way (the cache stays full, does not crash).
try:
    h.pwrite(b'x' * PAGE, failed_at + 2 * PAGE)
    raise AssertionError('second new-page write succeeded on a full cache')
except nbd.Error as e:
    assert e.errnum == errno.ENOSPC, e
# Everything written before reads back; the pages in between read as the base.
for off, data in written.items():
    assert h.pread(PAGE, off) == data, f'written page at {off} reads back wrong'
    assert h.pread(PAGE, off + PAGE) == base[off + PAGE:off + 2 * PAGE], f'unwritten page at {off + PAGE} is not the base'
tail = failed_at + PAGE
assert h.pread(size - tail, tail) == base[tail:], 'area past the last write is not the base'
# Overwrites of pages the cache holds still succeed, also unaligned inside a page.
first = min(written)
h.pwrite(b'O' * PAGE, first)
h.pwrite(b'partial', first + 2 * PAGE + 100)
written[first] = b'O' * PAGE
p = first + 2 * PAGE
written[p] = written[p][:100] + b'partial' + written[p][107:]
assert h.pread(PAGE, first) == written[first] and h.pread(PAGE, p) == written[p], 'overwrite lost'

# Trim 64 written pages: they read as zeros, and their RAM takes new pages again.
trimmed = sorted(written)[:64]
for off in trimmed:
    h.trim(PAGE, off)
for off in trimmed:
    assert h.pread(PAGE, off) == bytes(PAGE), f'trimmed page at {off} does not read as zeros'
    del written[off]
new = {}
for i in range(32):
    off = failed_at + 2 * PAGE * i
    data = os.urandom(PAGE)
    h.pwrite(data, off)                       # must not fail now
    new[off] = data
for off, data in list(new.items()) + list(written.items()):
    assert h.pread(PAGE, off) == data, f'page at {off} reads back wrong after the trim'
print(f'after trimming {len(trimmed)} pages, {len(new)} new pages were written')
"
log "ok: ENOSPC, data intact, overwrites work, trim frees RAM"
server_alive "$SERVER_PID" || fail "server died after ENOSPC"
timeout 10 nbdinfo --size "$URI" >/dev/null || fail "server does not answer a new connection after ENOSPC"
log "ok: server alive and answering"
rc=0
stop_server "$SERVER_PID" 15 || rc=$?
assert_eq "server exit status" "$rc" 0
cmp "$base" "$E2E_TMP/base.pristine" || fail "the base file was modified"
log "ok: base file unchanged"
