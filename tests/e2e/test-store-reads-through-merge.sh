#!/usr/bin/env bash
# A target keeps reading its version while the store moves on. A server serves what
# production gets (version 2); a reader loop (nbdsh, random 64 KiB reads checked against
# a flattened copy) runs while version 3 is made, promoted to production and the versions
# are merged. The reader sees no error and no changed byte; the files it reads are retired,
# not deleted, while the server runs (`vdisk info` lists them), and are deleted by
# `vdisk gc` once it has stopped. A new server gets the merged version.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
require qemu-img qemu-io nbdinfo nbdsh
require_python_nbd
require_vdstream
e2e_init
store_init

make_sparse_image "$E2E_TMP/golden.raw" 64
vds vdisk import r "$E2E_TMP/golden.raw" >/dev/null
dir=$STORE/vdisks/r
new_patched_version r production 0 8M 0x51 >/dev/null
new_patched_version r production 30M 8M 0x52 >/dev/null
qemu-img convert -O raw "$dir/r.2.qcow2" "$E2E_TMP/v2.raw"

start_server --vdisk r --store "$STORE"
grep -q "version 2 (production)" "$SERVER_LOG" || fail "the server did not say it serves version 2: $(cat "$SERVER_LOG")"
reader_uri=$URI
stop_flag=$E2E_TMP/stop
timeout 60 nbdsh -u "$reader_uri" -c "
import os, random, time
expect = open('$E2E_TMP/v2.raw', 'rb').read()
n, deadline = 0, time.time() + 40
while not os.path.exists('$stop_flag') and time.time() < deadline:
    off = random.randrange(0, len(expect) - 65536)
    assert h.pread(65536, off) == expect[off:off + 65536], 'bytes changed at %d' % off
    n += 1
open('$E2E_TMP/reads', 'w').write(str(n))
" >"$E2E_TMP/reader.log" 2>&1 &
reader=$!
track_pid "$reader"
sleep 0.5

first_server=$SERVER_PID
v3=$(new_patched_version r production 0 64k 0x53)
qemu-img convert -O raw "$dir/r.$v3.qcow2" "$E2E_TMP/v3.raw"
vds version merge r --json >"$E2E_TMP/merge.json"
assert_eq "merged" "$(json_get "$E2E_TMP/merge.json" 'j["merge"]["merged"]')" "[1, 2, 3]"
assert_eq "still in use" "$(json_get "$E2E_TMP/merge.json" 'sorted(j["merge"]["still_in_use"])')" "['r.1.qcow2', 'r.2.qcow2']"
sleep 1
touch "$stop_flag"
wait "$reader" || fail "the reader failed during promote and merge: $(cat "$E2E_TMP/reader.log")"
log "ok: $(cat "$E2E_TMP/reads") reads during promote and merge, all unchanged"

[[ -e $dir/r.1.qcow2 && -e $dir/r.2.qcow2 ]] || fail "a file the running server reads was deleted"
[[ ! -e $dir/r.3.qcow2 ]] || fail "version 3, read by nobody, was not deleted"
vds vdisk info r --json >"$E2E_TMP/info.json"
assert_eq "retired" "$(json_get "$E2E_TMP/info.json" 'sorted(j["meta"]["retired"])')" "['r.1.qcow2', 'r.2.qcow2']"
vds vdisk gc >/dev/null
[[ -e $dir/r.1.qcow2 ]] || fail "gc deleted a file the running server reads"

stop_server "$first_server" 15 || fail "the first server did not stop cleanly"
vds vdisk gc --json >"$E2E_TMP/gc.json"
assert_eq "deleted by gc" "$(json_get "$E2E_TMP/gc.json" 'sorted(d["file"] for d in j)')" "['r.1.qcow2', 'r.2.qcow2']"
[[ ! -e $dir/r.1.qcow2 && ! -e $dir/r.2.qcow2 ]] || fail "retired files still there after the server stopped and gc ran"

served_raw r "$E2E_TMP/now.raw"
grep -q "version 4 (production)" "$SERVER_LOG" || fail "a new server does not get the merged version 4"
cmp "$E2E_TMP/now.raw" "$E2E_TMP/v3.raw" || fail "the merged version serves other bytes than version 3 did"
log "ok: a new target gets the merged version with the same bytes"
