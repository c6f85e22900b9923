#!/usr/bin/env bash
# A file-backed export keeps its data across a server restart: data written (and
# flushed) through one server run is read back, unchanged, through the next run, and the
# export's size is still the file's size; the file was not grown by serving it.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdsh
require_python_nbd
e2e_init

img=$E2E_TMP/disk.img
make_sparse_image "$img" 24
start_server "$img"
nbdsh_script "
import hashlib
h.pwrite(bytes(range(256)) * 4096, 5 << 20)     # 1 MiB at 5 MiB
h.pwrite(b'end!', (24 << 20) - 4)
h.flush()
open('$E2E_TMP/sum', 'w').write(hashlib.sha256(h.pread(24 << 20, 0)).hexdigest())
"
rc=0
stop_server "$SERVER_PID" 15 || rc=$?
assert_eq "first server exit status" "$rc" 0

assert_eq "file size after serving" "$(stat -c %s "$img")" $((24 * 1024 * 1024))
assert_eq "file content = what the export served" "$(sha256sum <"$img" | cut -d' ' -f1)" "$(cat "$E2E_TMP/sum")"
start_server --read-only "$img"
nbdsh_script "
import hashlib
assert hashlib.sha256(h.pread(24 << 20, 0)).hexdigest() == open('$E2E_TMP/sum').read(), 'data changed across restart'
assert h.pread(4, (24 << 20) - 4) == b'end!'
"
