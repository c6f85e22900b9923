#!/usr/bin/env bash
# ram-overflow with a capped overflow file answers ENOSPC when RAM and file are both full:
# `--cache ram-overflow --ram 1M --overflow-max 4M` over a 32 MiB base; nbdsh writes new
# 4 KiB pages (every other page, random contents, so they spread over many 2 MiB regions)
# until one fails. The failure is ENOSPC (libnbd .errnum == errno.ENOSPC), after at least
# the RAM's worth (1 MiB) and before the 16 MiB written; the server does not crash; every
# page written before reads back (from RAM or the overflow file), pages never written read
# as the base; overwrites of written pages still succeed; trimming a whole 2 MiB region's
# pages frees space, so new writes succeed again. The base file is unchanged.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdsh nbdinfo cmp
require_python_nbd
require_vdstream
e2e_init

base=$E2E_TMP/base.img
make_sparse_image "$base" 32
dd if=/dev/urandom of="$base" bs=1M seek=2 count=4 conv=notrunc status=none
cp --sparse=always "$base" "$E2E_TMP/base.pristine"
dir=$E2E_TMP/overflow
mkdir "$dir"

start_server "$base" --cache ram-overflow --ram 1M --overflow-max 4M --overflow-dir "$dir"
nbdsh_script "
import errno, os, nbd
PAGE, MiB = 4096, 1 << 20
base = open('$base', 'rb').read()
size = h.get_size()
assert size == len(base) == 32 * MiB, size

written = {}
err = None
for off in range(0, size, 2 * PAGE):
    data = os.urandom(PAGE)
    try:
        h.pwrite(data, off)
    except nbd.Error as e:
        err, failed_at = e, off
        break
    written[off] = data
assert err is not None, 'no write failed: 16 MiB of new pages fitted in 1 MiB RAM + 4 MiB overflow'
print(f'write {len(written) + 1} (offset {failed_at}) failed: {err} (errnum {err.errnum}); '
      f'{len(written) * PAGE >> 10} KiB written before')
assert err.errnum == errno.ENOSPC and err.errno == 'ENOSPC', f'want ENOSPC, got {err.errno} ({err.errnum}): {err}'
assert len(written) * PAGE >= MiB, f'ENOSPC after only {len(written)} pages (RAM alone holds 1 MiB)'
assert h.pread(PAGE, failed_at) == base[failed_at:failed_at + PAGE], 'failed write left data behind'
try:
    h.pwrite(b'x' * PAGE, failed_at + 2 * PAGE)
    raise AssertionError('second new-page write succeeded on a full cache')
except nbd.Error as e:
    assert e.errnum == errno.ENOSPC, e

for off, data in written.items():
    assert h.pread(PAGE, off) == data, f'written page at {off} reads back wrong'
    assert h.pread(PAGE, off + PAGE) == base[off + PAGE:off + 2 * PAGE], f'unwritten page at {off + PAGE} is not the base'
tail = failed_at + PAGE
assert h.pread(size - tail, tail) == base[tail:], 'area past the last write is not the base'
# Overwrites of held pages (wherever they live now) still succeed.
for off in sorted(written)[::37]:
    data = os.urandom(PAGE)
    h.pwrite(data, off)
    written[off] = data
for off, data in written.items():
    assert h.pread(PAGE, off) == data, f'page at {off} reads back wrong after overwrites'

# Trim the first 2 MiB region whole: its pages read as zeros, and space comes back.
h.trim(2 * MiB, 0)
assert h.pread(2 * MiB, 0) == bytes(2 * MiB), 'trimmed region does not read as zeros'
for off in [o for o in written if o < 2 * MiB]:
    del written[off]
new = {}
for i in range(64):
    off = failed_at + 2 * PAGE * i
    data = os.urandom(PAGE)
    h.pwrite(data, off)
    new[off] = data
for off, data in list(new.items()) + list(written.items()):
    assert h.pread(PAGE, off) == data, f'page at {off} reads back wrong after the trim'
print(f'after trimming 2 MiB, {len(new)} new pages were written')
"
log "ok: ENOSPC, data intact, overwrites work, trim frees space"
server_alive "$SERVER_PID" || fail "server died after ENOSPC"
timeout 10 nbdinfo --size "$URI" >/dev/null || fail "server does not answer a new connection after ENOSPC"
log "ok: server alive and answering"
rc=0
stop_server "$SERVER_PID" 15 || rc=$?
assert_eq "server exit status" "$rc" 0
cmp "$base" "$E2E_TMP/base.pristine" || fail "the base file was modified"
log "ok: base file unchanged"
