#!/usr/bin/env bash
# A private-access vDisk is one writer's disk: served read-write on its base with no
# cache, a second writer is refused naming the holder, --cache is refused, it has no
# versions, and what the writer wrote is in the base after it stops.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
require qemu-img qemu-io nbdinfo
require_vdstream
e2e_init
store_init

make_sparse_image "$E2E_TMP/golden.raw" 32
vds vdisk import p "$E2E_TMP/golden.raw" --access private >/dev/null
vds version new p 2>"$E2E_TMP/err" && fail "a private vDisk got a version"
grep -q "private access" "$E2E_TMP/err" || fail "the refusal does not say private: $(cat "$E2E_TMP/err")"
"$VDSTREAM_BIN" serve-image --vdisk p --store "$STORE" --cache device-ram --socket "$E2E_TMP/c.sock" 2>"$E2E_TMP/err" &&
    fail "a private vDisk was served through a cache"
grep -q "drop --cache" "$E2E_TMP/err" || fail "the --cache refusal does not say what to do"

start_server --vdisk p --store "$STORE"
grep -q "read-write" "$SERVER_LOG" || fail "the private vDisk is not served read-write"
qemu-io -f raw -c "write -P 0x77 2M 1M" "$URI" >/dev/null || fail "write to the private vDisk failed"
rc=0
timeout 15 "$VDSTREAM_BIN" serve-image --vdisk p --store "$STORE" --socket "$E2E_TMP/second.sock" 2>"$E2E_TMP/err" || rc=$?
((rc != 0 && rc != 124)) || fail "a second writer on the private vDisk was not refused"
grep -q "pid $SERVER_PID" "$E2E_TMP/err" || fail "the refusal does not name the holder: $(cat "$E2E_TMP/err")"
stop_server "$SERVER_PID" 15 || fail "the private server did not stop cleanly"
qemu-io -f raw -c "read -P 0x77 2M 1M" "$STORE/vdisks/p/p.base.raw" >/dev/null || fail "the write is not in the base"
log "ok: private access has one writer and writes to the base"

vds vdisk set p --access standard >/dev/null
v=$(vds version new p --json | json_get /dev/stdin 'j["version"]["number"]')
assert_eq "first version after switching to standard" "$v" 1
vds vdisk set p --access private 2>"$E2E_TMP/err" && fail "a vDisk with versions became private"
grep -q "merge" "$E2E_TMP/err" || fail "the refusal does not say what to do"
