#!/usr/bin/env bash
# The server-side cache types of a store vDisk keep their file in the store's cache/
# folder (one file per target, named after the export), not in a temporary directory:
# a server-persistent cache found there again after a restart still holds the target's
# flushed writes, and the vDisk itself is untouched.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
require qemu-io
require_vdstream
e2e_init
store_init

vds vdisk create golden --size 32M >/dev/null
start_server --vdisk golden --store "$STORE" --cache server-persistent --name target-7
qemu-io -f raw -c "write -P 0x5c 1M 64k" -c flush "$URI" >/dev/null || fail "write through the server cache failed"
ls "$STORE/cache/" | grep -q "target-7" || fail "no cache file for target-7 in $STORE/cache: $(ls -la "$STORE/cache" 2>&1)"
stop_server "$SERVER_PID" 15 || fail "the server did not stop cleanly"

start_server --vdisk golden --store "$STORE" --cache server-persistent --name target-7
qemu-io -f raw -c "read -P 0x5c 1M 64k" "$URI" >/dev/null || fail "the flushed write is gone after a restart"
stop_server "$SERVER_PID" 15 || fail "the server did not stop cleanly"

served_raw golden "$E2E_TMP/vdisk.raw"
qemu-io -f raw -c "read -P 0 1M 64k" "$E2E_TMP/vdisk.raw" >/dev/null || fail "the write reached the vDisk"
log "ok: server-persistent cache kept in $STORE/cache and found again"
