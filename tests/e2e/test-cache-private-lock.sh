#!/usr/bin/env bash
# `private` mode has one writer per vDisk file: while `serve-image FILE --cache private`
# runs, a second `serve-image FILE --cache private` (another socket) is refused at start —
# exit status non-zero within a few seconds, no socket left behind, and stderr names the
# file. The first server keeps serving (a write and read back work). Once the first one
# has stopped, the lock is gone and a new private server starts on the same file.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdsh nbdinfo
require_python_nbd
require_vdstream
e2e_init

img=$E2E_TMP/disk.img
make_sparse_image "$img" 16
start_server "$img" --cache private
first=$SERVER_PID

sock2=$E2E_TMP/second.sock
rc=0
timeout --kill-after=5 15 "$VDSTREAM_BIN" serve-image "$img" --cache private --socket "$sock2" \
    >"$E2E_TMP/second.out" 2>"$E2E_TMP/second.err" </dev/null || rc=$?
log "second server: exit status $rc, stderr:"
cat "$E2E_TMP/second.err" >&2
[[ $rc -ne 124 && $rc -ne 137 ]] || fail "the second private server on $img started and kept running"
[[ $rc -ne 0 ]] || fail "the second private server on $img exited 0"
grep -qF "$img" "$E2E_TMP/second.err" || fail "the second server's error does not name the file $img"
grep -Eqi 'lock|in use|another|already|writer' "$E2E_TMP/second.err" ||
    fail "the second server's error does not say the file is in use"
[[ ! -e $sock2 ]] || fail "the refused server left its socket $sock2 behind"
log "ok: second private server refused, naming the file"

server_alive "$first" || fail "the first server died"
nbdsh_script "
h.pwrite(b'still mine', 4096)
assert h.pread(10, 4096) == b'still mine'
flush_if_offered()
"
log "ok: first server still serves writes"
rc=0
stop_server "$first" 15 || rc=$?
assert_eq "first server exit status" "$rc" 0
[[ $(dd if="$img" bs=1 skip=4096 count=10 status=none) == "still mine" ]] || fail "private write not in the file"

start_server "$img" --cache private
log "ok: a new private server starts once the first has stopped"
