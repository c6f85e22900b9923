#!/usr/bin/env bash
# Failures reach the server log, not only the client: a refused open (an unknown export,
# a busy maintenance version) and an I/O error (a layer file truncated under a live
# connection) each give a line naming the client, the export and the reason; a flood of
# them is rate-limited, with a "suppressed N similar lines" line instead of the rest.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=server-lib.sh
source "$E2E_DIR/server-lib.sh"
require nbdsh
require_vdstream
require_python_nbd
e2e_init
store_init

head -c $((8 << 20)) /dev/urandom >"$E2E_TMP/e.img"
vds vdisk import e "$E2E_TMP/e.img" >/dev/null
vds vdisk create w --size 8M >/dev/null
vds version new w >/dev/null
start_store_server --read-cache 0

# An unknown export.
got=$(refusal vdisk/nope)
[[ $got == *"0x80000006"* ]] || fail "vdisk/nope: want NBD_REP_ERR_UNKNOWN, got: $got"
grep -q 'open refused (unknown export): client unix, export "vdisk/nope" (NBD_OPT_GO): .*no vDisk named "nope"' "$SERVER_LOG" ||
    fail "the refusal of an unknown export is not in the server log"
log "ok: an unknown export's refusal is logged"

# A busy maintenance version: a second writer.
"$PY" "$E2E_DIR/hold_conns.py" "$SOCK" maintenance/w 1 "$E2E_TMP/writer" "$E2E_TMP/writer.stop" &
track_pid $!
for ((i = 0; i < 100; i++)); do [[ -e $E2E_TMP/writer ]] && break; sleep 0.1; done
assert_eq "the first writer" "$(cat "$E2E_TMP/writer" 2>/dev/null)" accepted
got=$(refusal maintenance/w)
[[ $got == *"0x80000002"* ]] || fail "a second writer: want NBD_REP_ERR_POLICY, got: $got"
grep -q 'open refused (busy): client unix, export "maintenance/w" (NBD_OPT_GO): .*one writer' "$SERVER_LOG" ||
    fail "the refusal of a second writer is not in the server log"
touch "$E2E_TMP/writer.stop"
log "ok: a busy export's refusal is logged"

# An I/O error: the base file is cut short under a live connection; reading past the cut
# is EIO, and the log names the client, the export and what failed. Then a flood of them
# on the same connection is rate-limited, and what was held back is counted.
base=$(ls "$STORE"/vdisks/e/e.base.*)
timeout 60 nbdsh -u "$(xuri vdisk/e)" -c "
import os, time
os.truncate('$base', 2 << 20)
try:
    h.pread(65536, 6 << 20)
    raise SystemExit('a read past the end of the cut file succeeded')
except nbd.Error as e:
    assert '(EIO)' in str(e), e
for _ in range(300):
    try:
        h.pread(4096, 7 << 20)
    except nbd.Error:
        pass
time.sleep(0.5)
try:
    h.pread(4096, 7 << 20)
except nbd.Error:
    pass
" || fail "reading the cut file did not give EIO"
grep -q "I/O error: client unix, export \"vdisk/e\", read of 65536 bytes at 6291456: .*$base" "$SERVER_LOG" ||
    fail "the I/O error is not in the server log"
log "ok: an I/O error is logged with the client, the export and the file"
lines=$(grep -c 'I/O error: client unix' "$SERVER_LOG")
((lines < 100)) || fail "302 I/O errors gave $lines log lines: not rate-limited"
grep -q '(I/O error: suppressed [0-9]* similar lines)' "$SERVER_LOG" || fail "the lines held back are not counted in the log"
log "ok: 302 I/O errors gave $lines lines and a count of the rest: $(grep -o 'suppressed [0-9]* similar lines' "$SERVER_LOG")"
stop_server "$SERVER_PID" 15 || fail "the server did not stop cleanly"
