#!/usr/bin/env bash
# The store follows no symbolic link. A server-persistent target's attach record
# (cache/ID.vdattach) replaced by a link to another file: the next attach is refused, the
# server's log names the link, and the file it points to keeps its bytes and its mode (no
# secret written into it, no chmod). A layer file replaced by a link to a host file: the
# export is refused with the link named, `vdisk export` fails, and the host file's marker
# is served nowhere. A vDisk folder replaced by a link is refused too.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
source "$(dirname "$0")/server-lib.sh"
require nbdsh nbdinfo nbdcopy qemu-io
require_python_nbd
require_vdstream
is_vdstream || skip "the store is vdstream's"
e2e_init
store_init

host_secret 4

golden_vdisk w 4
vds target add p1 --vdisk w --cache server-persistent >/dev/null

# attach_p1 — opens target/p1 (a new attach) and writes a little; prints "ok" or the error.
attach_p1() {
    timeout 30 nbdsh -u "$(xuri target/p1)" -c '
h.pwrite(b"\x5a" * 4096, 0)
h.flush()
print("ok")' 2>&1 | tail -n 1
}

# --- the attach record
start_store_server
[[ $(attach_p1) == ok ]] || fail "the first attach of p1 failed: $(tail -n 5 "$SERVER_LOG")"
stop_server "$SERVER_PID" 15 || fail "the server did not stop cleanly"
record=$(ls "$STORE"/cache/*.vdattach) || fail "no attach record in $STORE/cache"
victim=$E2E_TMP/victim
printf 'VICTIM-CONTENT\n' >"$victim"
chmod 644 "$victim"
rm -f "$record"
ln -s "$victim" "$record"
start_store_server
r=$(attach_p1 || true)
[[ $r != ok ]] || fail "an attach of p1 went through the attach record's link"
grep -q "$(basename "$record") is a symbolic link" "$SERVER_LOG" || fail "the server's log does not name the link: $(tail -n 5 "$SERVER_LOG")"
assert_eq "content of the file the link points to" "$(cat "$victim")" VICTIM-CONTENT
assert_eq "mode of the file the link points to" "$(stat -c %a "$victim")" 644
stop_server "$SERVER_PID" 15 || fail "the server did not stop cleanly"
rm -f "$record"

# --- a layer file
# (The server starts first: `nbdinfo --list`, its readiness check, would fail on the
# broken vDisk, as it should.)
start_store_server
base=$STORE/vdisks/w/w.base.raw
mv "$base" "$E2E_TMP/base.keep"
ln -s "$secret" "$base"
if nbdcopy "$(xuri vdisk/w@base)" "$E2E_TMP/served.raw" 2>"$E2E_TMP/err"; then
    fail "vdisk/w@base was served through the layer's link"
fi
grep -q "w.base.raw is a symbolic link" "$SERVER_LOG" || fail "the server's log does not name the layer's link: $(tail -n 5 "$SERVER_LOG")"
if vds vdisk export w "$E2E_TMP/export.raw" 2>"$E2E_TMP/err"; then fail "vdisk export read through the layer's link"; fi
grep -q "symbolic link" "$E2E_TMP/err" || fail "vdisk export does not say why: $(cat "$E2E_TMP/err")"
for f in "$E2E_TMP/served.raw" "$E2E_TMP/export.raw"; do
    if [[ -e $f ]] && grep -qF "$marker" "$f"; then fail "$f holds the host file"; fi
done
stop_server "$SERVER_PID" 15 || fail "the server did not stop cleanly"
rm -f "$base"
mv "$E2E_TMP/base.keep" "$base"

# --- a vDisk folder
mv "$STORE/vdisks/w" "$E2E_TMP/w.keep"
ln -s "$E2E_TMP/w.keep" "$STORE/vdisks/w"
if vds vdisk info w 2>"$E2E_TMP/err"; then fail "vdisk info went through the vDisk folder's link"; fi
grep -q "is a symbolic link" "$E2E_TMP/err" || fail "vdisk info does not say why: $(cat "$E2E_TMP/err")"
log "ok"
