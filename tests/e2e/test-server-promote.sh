#!/usr/bin/env bash
# A promote while a session is open: the open session keeps reading the version it
# connected to; a new connection to vdisk/NAME gets the new production version, and the
# description names it.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=server-lib.sh
source "$E2E_DIR/server-lib.sh"
require nbdinfo qemu-io nbdsh
require_vdstream
require_python_nbd
e2e_init
store_init

vds vdisk create w --size 8M >/dev/null
v1=$(new_patched_version w production 1M 64k 0x11)
v2=$(new_patched_version w test 1M 64k 0x22)

start_store_server
# A session on vdisk/w that stays open across the promote (bounded waits).
nbdsh -u "$(xuri vdisk/w)" -c "
import os, time
assert h.pread(65536, 1 << 20) == b'\x11' * 65536
open('$E2E_TMP/open', 'w').write(h.get_export_name())
for _ in range(300):
    if os.path.exists('$E2E_TMP/promoted'):
        break
    time.sleep(0.1)
else:
    raise SystemExit('never promoted')
assert h.pread(65536, 1 << 20) == b'\x11' * 65536, 'the open session moved to the new version'
" &
session=$!
track_pid "$session"
for _ in $(seq 100); do [[ -e $E2E_TMP/open ]] && break; sleep 0.1; done
[[ -e $E2E_TMP/open ]] || fail "the session did not open"

vds version promote w "$v2" --to production >/dev/null
touch "$E2E_TMP/promoted"
wait "$session" || fail "the open session did not keep version $v1"
log "ok: the open session kept version $v1"

qemu-io -r -f raw -c "read -P 0x22 1M 64k" "$(xuri vdisk/w)" >/dev/null || fail "a new connection does not get version $v2"
desc=$(nbdinfo --json "$(xuri vdisk/w)" | json_get /dev/stdin 'j["exports"][0]["description"]')
assert_eq "description after the promote" "$desc" "vdisk/w@$v2 (production)"
qemu-io -r -f raw -c "read -P 0x11 1M 64k" "$(xuri "vdisk/w@$v1")" >/dev/null || fail "vdisk/w@$v1 does not keep its bytes"
stop_server "$SERVER_PID" 15 || fail "the server did not stop cleanly"
