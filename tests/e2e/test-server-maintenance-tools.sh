#!/usr/bin/env bash
# The maintenance export takes one writer, so it must not advertise multi-conn (the
# read-only vdisk/ exports still do): libnbd's nbdcopy and nbdfuse, with their defaults,
# open as many connections as multi-conn allows, and a second one would be refused
# ("server policy prevents NBD_OPT_GO"). With their defaults they must copy from and to
# maintenance/NAME and read and write it through FUSE, on `vdstream server` and on
# `vdstream serve-image --vdisk NAME@maintenance`.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=server-lib.sh
source "$E2E_DIR/server-lib.sh"
require nbdinfo nbdcopy nbdfuse
require_vdstream
e2e_init
store_init

vds vdisk create w --size 8M >/dev/null
vds version new w >/dev/null
head -c $((8 << 20)) /dev/urandom >"$E2E_TMP/new.raw"

mnt=$E2E_TMP/mnt
fuse_pid=
unmount() {
    if [[ -n $fuse_pid ]]; then
        umount "$mnt" 2>/dev/null || umount -l "$mnt" 2>/dev/null || true
        stop_pid "$fuse_pid" 2>/dev/null || true
        fuse_pid=
    fi
}

# tools URI LABEL — nbdcopy to and from URI, then nbdfuse reads and writes it; all defaults.
tools() {
    local uri=$1 label=$2 i rc=0
    nbdinfo --can multi-conn "$uri" || rc=$?
    [[ $rc == 2 ]] || fail "$label: nbdinfo --can multi-conn: want 2 (no), got $rc: it takes one connection"
    timeout 60 nbdcopy "$E2E_TMP/new.raw" "$uri" 2>"$E2E_TMP/copy.err" || fail "$label: nbdcopy to it failed: $(cat "$E2E_TMP/copy.err")"
    timeout 60 nbdcopy "$uri" "$E2E_TMP/back.raw" 2>"$E2E_TMP/copy.err" || fail "$label: nbdcopy from it failed: $(cat "$E2E_TMP/copy.err")"
    cmp "$E2E_TMP/new.raw" "$E2E_TMP/back.raw" || fail "$label: nbdcopy read back other bytes than it wrote"
    log "ok: $label: nbdcopy to and from it, with its defaults"

    mkdir -p "$mnt"
    nbdfuse "$mnt" "$uri" 2>"$E2E_TMP/fuse.err" &
    fuse_pid=$!
    track_pid "$fuse_pid"
    for ((i = 0; i < 100; i++)); do
        [[ -e $mnt/nbd ]] && break
        kill -0 "$fuse_pid" 2>/dev/null || fail "$label: nbdfuse exited: $(cat "$E2E_TMP/fuse.err")"
        sleep 0.1
    done
    [[ -e $mnt/nbd ]] || fail "$label: nbdfuse did not mount within 10 s"
    head -c 65536 /dev/urandom >"$E2E_TMP/pat"
    dd if="$E2E_TMP/pat" of="$mnt/nbd" bs=64k seek=5 conv=notrunc,fsync status=none || fail "$label: writing through nbdfuse failed"
    cmp <(dd if="$mnt/nbd" bs=64k skip=5 count=1 status=none) "$E2E_TMP/pat" || fail "$label: nbdfuse read back other bytes"
    cmp -n 65536 "$mnt/nbd" "$E2E_TMP/new.raw" || fail "$label: nbdfuse reads other bytes than nbdcopy wrote"
    unmount
    log "ok: $label: nbdfuse reads and writes it, with its defaults"
}

start_store_server
nbdinfo --can multi-conn "$(xuri vdisk/w)" || fail "the read-only vdisk/w lost multi-conn"
tools "$(xuri maintenance/w)" "maintenance/w on vdstream server"
got=$(grep -c 'refused' "$SERVER_LOG" || true)
[[ $got == 0 ]] || fail "the server refused connections meanwhile: $(grep refused "$SERVER_LOG")"
stop_server "$SERVER_PID" 15 || fail "the server did not stop cleanly"

# The data is in the version, and serve-image's maintenance export behaves the same.
dd if="$E2E_TMP/pat" of="$E2E_TMP/new.raw" bs=64k seek=5 conv=notrunc status=none
start_server --vdisk w@maintenance --store "$STORE"
timeout 60 nbdcopy "$URI" "$E2E_TMP/served.raw" || fail "nbdcopy from serve-image's maintenance export failed"
cmp "$E2E_TMP/new.raw" "$E2E_TMP/served.raw" || fail "the maintenance version does not hold what was written"
head -c $((8 << 20)) /dev/urandom >"$E2E_TMP/new.raw"
tools "$URI" "serve-image --vdisk w@maintenance"
stop_server "$SERVER_PID" 15 || fail "serve-image did not stop cleanly"
log "ok: maintenance exports work with nbdcopy and nbdfuse defaults"
