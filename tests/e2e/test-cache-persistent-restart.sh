#!/usr/bin/env bash
# A persistent write cache survives a crash, a non-persistent one starts empty:
# `--cache device-disk-persistent --overflow-dir DIR --name t1` over a 32 MiB base:
# nbdsh writes a pattern (aligned, unaligned, a zeroed and a trimmed range) and flushes;
# the server is killed with SIGKILL (no clean shutdown); a new server with the same
# arguments serves exactly what was flushed, and the rest still reads as the base. Then
# `--cache device-disk` (same dir, another name): written (+ flushed if offered), SIGKILL, restart —
# the export reads as the base again. The base file is never modified.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdsh cmp sha256sum
require_python_nbd
require_vdstream
e2e_init

base=$E2E_TMP/base.img
make_sparse_image "$base" 32
dd if=/dev/urandom of="$base" bs=1M seek=8 count=4 conv=notrunc status=none
cp --sparse=always "$base" "$E2E_TMP/base.pristine"
dir=$E2E_TMP/cache
mkdir "$dir"
want=$E2E_TMP/want.img       # what the export should serve: base + the pattern
cp --sparse=always "$base" "$want"

kill9() {
    kill -KILL "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
    ! server_alive "$SERVER_PID" || fail "server survived SIGKILL"
}

# The pattern, applied both to the export (h) and to a plain file (want).
PATTERN="
import os, random
MiB = 1 << 20
rnd = random.Random(1234)
def ops():
    yield 'w', bytes(rnd.randrange(256) for _ in range(64 * 1024)), 0               # over random base
    yield 'w', bytes(range(256)) * 4096, 9 * MiB                                      # 1 MiB over random base
    yield 'w', b'unaligned write!' * 100, 5 * MiB + 1234                              # partial pages over a hole
    yield 'w', b'tail', 32 * MiB - 4
    yield 'z', 256 * 1024, 10 * MiB                                                   # zero over random base
    yield 't', 128 * 1024, 9 * MiB + 256 * 1024                                       # trim inside the written MiB
    yield 'w', os.urandom(4096) * 8, 20 * MiB
    yield 'w', b'second write wins' * 10, 9 * MiB + 100                               # overwrite
"

start_server "$base" --cache device-disk-persistent --overflow-dir "$dir" --name t1
nbdsh_script "
$PATTERN
with open('$want', 'r+b') as f:
    for op, a, off in ops():
        if op == 'w':
            h.pwrite(a, off); f.seek(off); f.write(a)
        elif op == 'z':
            h.zero(a, off); f.seek(off); f.write(bytes(a))
        else:
            h.trim(a, off); f.seek(off); f.write(bytes(a))   # a trimmed page reads as zeros in a cache
h.flush()
import hashlib
got = h.pread(32 * MiB, 0)
assert got == open('$want', 'rb').read(), 'export does not serve the pattern before the crash'
"
log "ok: pattern written and flushed"
kill9
log "server killed with SIGKILL"
cmp "$base" "$E2E_TMP/base.pristine" || fail "device-disk-persistent modified the base file"

start_server "$base" --cache device-disk-persistent --overflow-dir "$dir" --name t1
nbdsh_script "
got = h.pread(32 << 20, 0)
want = open('$want', 'rb').read()
if got != want:
    bad = [i for i in range(0, len(want), 4096) if got[i:i + 4096] != want[i:i + 4096]]
    raise AssertionError(f'{len(bad)} pages differ after the restart, first at offsets {bad[:8]}')
"
log "ok: device-disk-persistent serves the flushed pattern after SIGKILL + restart"
# A clean stop, a third open: still there.
rc=0
stop_server "$SERVER_PID" 15 || rc=$?
assert_eq "server exit status (SIGTERM)" "$rc" 0
start_server "$base" --cache device-disk-persistent --overflow-dir "$dir" --name t1
nbdsh_script "assert h.pread(32 << 20, 0) == open('$want', 'rb').read(), 'pattern lost after a clean stop'"
log "ok: still there after a clean stop and a third open"
stop_server "$SERVER_PID" 15 || true

# Non-persistent device-disk: starts empty after a restart.
start_server "$base" --cache device-disk --overflow-dir "$dir" --name t2
nbdsh_script "
$PATTERN
for op, a, off in ops():
    if op == 'w':
        h.pwrite(a, off)
flush_if_offered()      # a non-persistent cache need not offer flush
assert h.pread(32 << 20, 0) != open('$base', 'rb').read(), 'device-disk did not take the writes'
"
kill9
start_server "$base" --cache device-disk --overflow-dir "$dir" --name t2
nbdsh_script "assert h.pread(32 << 20, 0) == open('$base', 'rb').read(), 'device-disk did not start empty after a restart'"
log "ok: device-disk starts empty after a restart"
stop_server "$SERVER_PID" 15 || true
cmp "$base" "$E2E_TMP/base.pristine" || fail "the base file was modified"
log "ok: base file unchanged"
