#!/usr/bin/env bash
# A persistent cache whose file system fills keeps flushing (issue 17, item 6):
# `serve-image --cache device-disk-persistent` with its cache folder on a 4 MiB tmpfs,
# over a 32 MiB base. nbdsh flushes a first batch, then writes page after page until the
# server answers ENOSPC; those writes (and only those) fail. Then a FLUSH covering the
# writes that fit succeeds, and so does a FLUSH with no new writes. The server logs the
# full file system (with the folder) and counts the refusals at exit; after SIGKILL and a
# restart every acknowledged write reads back and a refused page reads as the base.
# Needs root (it mounts a tmpfs).
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdsh mount umount
require_python_nbd
require_vdstream
[[ $(id -u) == 0 ]] || skip "mounting a small tmpfs needs root"
e2e_init

small=$E2E_TMP/small
mkdir "$small"
mount -t tmpfs -o size=4m,mode=0700 tmpfs "$small" || fail "cannot mount a 4 MiB tmpfs on $small"
# Unmount after the servers are stopped (the EXIT trap stops them first).
cleanup_mount() { stop_pid "$SERVER_PID" 5; umount "$small" 2>/dev/null || umount -l "$small"; }
trap 'rc=$?; cleanup_mount; (exit $rc); e2e_cleanup' EXIT

base=$E2E_TMP/base.img
make_sparse_image "$base" 32
dd if=/dev/urandom of="$base" bs=1M count=32 conv=notrunc status=none
acked=$E2E_TMP/acked.txt
args=(--cache device-disk-persistent --overflow-dir "$small/cache" --intermediate-buffering on --allow-low-space --name t1)

start_server "$base" "${args[@]}"
nbdsh_script "
import errno, nbd
P = 4096
def page(p): return bytes([p % 251 + 1]) * P
acked = []
for p in range(64):
    h.pwrite(page(p), p * P); acked.append(p)
h.flush()
acked += write_until_enospc(8, first_page=64)
assert len(acked) > 200, f'only {len(acked)} pages fit'
try:
    h.flush()
except nbd.Error as e:
    raise AssertionError(f'a FLUSH after the writes that did not fit failed: {e}')
try:
    h.flush()
except nbd.Error as e:
    raise AssertionError(f'a FLUSH with no new writes failed: {e}')
open('$acked', 'w').write(' '.join(map(str, acked)))
"
log "ok: writes that did not fit got ENOSPC; flushes after them succeed"
grep -q "file system of $small/cache is full" "$SERVER_LOG" || fail "the server did not log the full file system"
# The rate limit: one warning for the eight refusals.
n=$(grep -c "file system of $small/cache is full" "$SERVER_LOG")
assert_eq "warnings logged for 8 refusals" "$n" 1

kill -KILL "$SERVER_PID"; wait "$SERVER_PID" 2>/dev/null || true
start_server "$base" "${args[@]}"
nbdsh_script "
P = 4096
def page(p): return bytes([p % 251 + 1]) * P
acked = list(map(int, open('$acked').read().split()))
bad = [p for p in acked if h.pread(P, p * P) != page(p)]
assert not bad, f'{len(bad)} acknowledged pages lost after SIGKILL + restart, first {bad[:8]}'
after = acked[-1] + 1
base = open('$base', 'rb').read()
assert h.pread(P, after * P) == base[after * P:(after + 1) * P], 'a refused page does not read as the base'
import nbd
refused = 0
for p in range(after, after + 64):
    try:
        h.pwrite(page(p), p * P)
    except nbd.Error:
        refused += 1
assert refused > 0, 'the file system is still nearly full: some of 64 new pages must be refused'
h.flush()
"
log "ok: every acknowledged write survives SIGKILL + restart on the full file system"
rc=0
stop_server "$SERVER_PID" 15 || rc=$?
assert_eq "server exit status" "$rc" 0
grep -qE "[1-9][0-9]* writes refused for lack of space" "$SERVER_LOG" || fail "the exit report does not count the refusal: $(grep 'cache:' "$SERVER_LOG")"
log "ok: the exit report counts writes the file system refused"
