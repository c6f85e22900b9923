#!/usr/bin/env bash
# Writes, trims and write-zeroes sent to a --read-only export (libnbd strict mode off)
# fail with EPERM, reads still work, and the backing file is byte-for-byte unchanged.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdsh
require_python_nbd
e2e_init

img=$E2E_TMP/golden.img
make_sparse_image "$img" 16
sum_before=$(sha256sum <"$img")
start_server --read-only "$img"
nbdsh_script "
import errno
assert h.is_read_only(), 'export not flagged read-only'
h.set_strict_mode(0)
def expect_eperm(what, f, also=()):
    try:
        f()
    except nbd.Error as e:
        assert e.errnum == errno.EPERM or e.errnum in also, f'{what}: got {e.errno} ({e.string}), want EPERM'
        print(f'{what}: EPERM ok')
        return
    raise AssertionError(f'{what}: succeeded on a read-only export')
expect_eperm('write', lambda: h.pwrite(b'x' * 4096, 0))
# FUA on an export that does not offer it is itself invalid: EINVAL is fine then.
expect_eperm('FUA write', lambda: h.pwrite(b'x' * 4096, 4096, nbd.CMD_FLAG_FUA),
             () if h.can_fua() else (errno.EINVAL,))
expect_eperm('trim', lambda: h.trim(1 << 20, 0))
expect_eperm('zero', lambda: h.zero(1 << 20, 0))
first = h.pread(65536, 0)
assert first == open('$img', 'rb').read(65536), 'read does not match the file'
"
assert_eq "file checksum after refused writes" "$(sha256sum <"$img")" "$sum_before"
