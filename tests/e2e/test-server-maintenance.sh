#!/usr/bin/env bash
# maintenance/NAME has one writer: while one connection writes, a second is refused with
# a message naming the vDisk and who holds it; the data written is in the maintenance
# version after the writer disconnects (`vdisk export NAME@maintenance`), and the next
# writer is accepted.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=server-lib.sh
source "$E2E_DIR/server-lib.sh"
require nbdsh qemu-io
require_vdstream
require_python_nbd
e2e_init
store_init

vds vdisk create w --size 8M >/dev/null
vds version new w >/dev/null
start_store_server

nbdsh -u "$(xuri maintenance/w)" -c "
import os, time
h.pwrite(b'\x5a' * 65536, 2 << 20)
h.flush()
open('$E2E_TMP/writing', 'w').write('1')
for _ in range(300):
    if os.path.exists('$E2E_TMP/checked'):
        break
    time.sleep(0.1)
" &
writer=$!
track_pid "$writer"
for _ in $(seq 100); do [[ -e $E2E_TMP/writing ]] && break; sleep 0.1; done
[[ -e $E2E_TMP/writing ]] || fail "the writer did not connect"

got=$(refusal maintenance/w)
[[ $got == *"0x80000002"* ]] || fail "a second writer: want NBD_REP_ERR_POLICY, got: $got"
[[ $got == *"vDisk w"* && $got == *"one writer"* && $got == *"connection from unix"* ]] || fail "the refusal does not name the vDisk and the holder: $got"
log "ok: second writer refused: $got"
touch "$E2E_TMP/checked"
wait "$writer" || fail "the writer failed"

vds vdisk export w@maintenance "$E2E_TMP/m.raw" >/dev/null
qemu-io -r -f raw -c "read -P 0x5a 2M 64k" -c "read -P 0 0 64k" "$E2E_TMP/m.raw" >/dev/null || fail "the write is not in the maintenance version"
log "ok: the write is in the maintenance version"
qemu-io -f raw -c "write -P 0x6b 3M 4k" "$(xuri maintenance/w)" >/dev/null || fail "the next writer was refused"
stop_server "$SERVER_PID" 15 || fail "the server did not stop cleanly"
vds vdisk export w@maintenance "$E2E_TMP/m2.raw" --force >/dev/null
qemu-io -r -f raw -c "read -P 0x6b 3M 4k" "$E2E_TMP/m2.raw" >/dev/null || fail "the second writer's data is not in the version"
