#!/usr/bin/env bash
# Flush, FUA writes and NBD_CMD_CACHE succeed and keep data; on a file-backed export a
# FUA write and a flushed write are in the file when the server is still running.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdsh
require_python_nbd
e2e_init

img=$E2E_TMP/disk.img
truncate -s 16M "$img"
start_server "$img"
nbdsh_script "
MiB = 1 << 20
assert h.can_flush() and h.can_fua(), 'flush/FUA not advertised'
h.pwrite(b'\xaa' * 65536, 0, nbd.CMD_FLAG_FUA)
h.pwrite(b'\xbb' * 65536, MiB)
h.flush()
if h.can_cache():
    h.cache(4 * MiB, 0)
assert h.pread(65536, 0) == b'\xaa' * 65536
assert h.pread(65536, MiB) == b'\xbb' * 65536
h.flush()
"
"$PY" - "$img" <<'PYEOF' || fail "file does not hold the FUA/flushed writes"
import sys
f = open(sys.argv[1], 'rb')
assert f.read(65536) == b'\xaa' * 65536, 'FUA write not in file'
f.seek(1 << 20)
assert f.read(65536) == b'\xbb' * 65536, 'flushed write not in file'
PYEOF
log "ok: file holds the writes"
