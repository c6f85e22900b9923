#!/usr/bin/env bash
# A hand-made store is owner-only whatever the umask. With umask 000 (every file the
# system would make world-writable), a store made and used by vdstream has: server and
# server-persistent cache files, journals, checkpoints and attach records 0600, the token
# file 0600, no file readable or writable by others, and folders 0750 at most. A cache
# file loosened by hand is made 0600 again when the server next opens it.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
source "$(dirname "$0")/server-lib.sh"
require nbdsh nbdinfo qemu-io
require_python_nbd
require_vdstream
is_vdstream || skip "the store is vdstream's"
e2e_init
store_init
umask 000

golden_vdisk w 4
vds target add s1 --vdisk w --cache server >/dev/null
vds target add p1 --vdisk w --cache server-persistent >/dev/null
vds token add admin --role admin >/dev/null
start_store_server
for t in s1 p1; do
    timeout 30 nbdsh -u "$(xuri "target/$t")" -c '
h.pwrite(b"\x5a" * 65536, 0)
if h.can_flush():
    h.flush()' || fail "the guest of $t could not write"
done
# The caches are open now: check them while the server holds them, then after it stops.
check_modes() {
    local f mode bad=0
    # A checkpoint's .tmp can be renamed away between find and stat: what is gone has no mode.
    while IFS= read -r f; do
        mode=$(stat -c %a "$f" 2>/dev/null) || continue
        case $f in
        */cache/* | */api-tokens.json | */api-tokens.lock)
            [[ $mode == 600 ]] || { log "BAD: $f is $mode, want 600"; bad=1; } ;;
        *)
            (( (8#$mode & 8#027) == 0 )) || { log "BAD: $f is $mode: group-writable or open to others"; bad=1; } ;;
        esac
    done < <(find "$STORE" -type f)
    while IFS= read -r f; do
        mode=$(stat -c %a "$f" 2>/dev/null) || continue
        (( (8#$mode & 8#027) == 0 )) || { log "BAD: folder $f is $mode, want 0750 at most"; bad=1; }
    done < <(find "$STORE" -type d)
    ((bad == 0)) || fail "some store files or folders are not owner-only (umask 000)"
}
ls "$STORE"/cache/* >/dev/null 2>&1 || fail "no cache files in $STORE/cache"
[[ -e $STORE/api-tokens.json ]] || fail "no token file at $STORE/api-tokens.json"
check_modes
stop_server "$SERVER_PID" 15 || fail "the server did not stop cleanly"
check_modes

# A cache file loosened by hand is owner-only again once the server opens it.
f=$(ls "$STORE"/cache/* | grep -v vdattach | head -n 1)
chmod 666 "$f"
start_store_server
timeout 30 nbdsh -u "$(xuri target/p1)" -c 'h.pread(4096, 0)' >/dev/null || fail "p1 did not attach again"
check_modes
log "ok: every file and folder is owner-only under umask 000"
