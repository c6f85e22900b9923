#!/usr/bin/env bash
# SIGTERM while fio is writing (QD 16, 2 jobs) to a file-backed export: the server exits
# with status 0 within 15 s, the data acknowledged as flushed before the signal is in the
# file, fio notices the server went away (no hang), and the socket file is removed.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require fio nbdsh
require_python_nbd
e2e_init

img=$E2E_TMP/disk.img
truncate -s 256M "$img"
start_server "$img"
# Something the server has acknowledged as durable before the load starts.
nbdsh_script "h.pwrite(b'\\x5e' * 65536, 200 << 20); h.flush()"

fio --name=load --ioengine=nbd --uri="$URI" --rw=randwrite --bs=4k --size=64m \
    --iodepth=16 --numjobs=2 --offset_increment=64m --time_based --runtime=60 \
    >"$E2E_TMP/fio.out" 2>&1 &
fio_pid=$!
track_pid "$fio_pid"
sleep 3
kill -0 "$fio_pid" 2>/dev/null || { cat "$E2E_TMP/fio.out" >&2; fail "fio stopped before the signal"; }

start=$SECONDS
rc=0
stop_server "$SERVER_PID" 15 || rc=$?
log "server exit status $rc after $((SECONDS - start)) s"
[[ $rc -ne 124 ]] || fail "server still running 15 s after SIGTERM under load (killed)"
assert_eq "server exit status after SIGTERM" "$rc" 0

# fio must not hang on a server that went away.
for _ in $(seq 200); do kill -0 "$fio_pid" 2>/dev/null || break; sleep 0.1; done
if kill -0 "$fio_pid" 2>/dev/null; then fail "fio still running 20 s after the server exited"; fi

"$PY" -c "
import sys
f = open(sys.argv[1], 'rb'); f.seek(200 << 20)
assert f.read(65536) == b'\x5e' * 65536, 'flushed data lost'" "$img" || fail "data flushed before SIGTERM is not in the file"
# vdstream removes its socket file on a clean exit (nbdkit, the stand-in, leaves it).
if [[ -e $SOCK ]]; then
    if is_vdstream; then fail "socket file $SOCK left behind after a clean exit"; fi
    log "NOTE: socket file $SOCK was left behind after exit"
else
    log "ok: socket file removed on exit"
fi
