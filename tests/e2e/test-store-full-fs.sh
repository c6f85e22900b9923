#!/usr/bin/env bash
# A store on a full file system: a failed `version new` (and a failed import) leaves
# nothing behind, so the next `version new` works once there is room; and `vdisk gc`
# deletes what a crash leaves: a layer file the metadata does not list, a temporary
# file of a dead process, but not an unlisted file a process still holds.
# The store lives on a 4 MiB tmpfs mounted for the test (needs root).
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
require qemu-img mount umount
require_vdstream
[[ $(id -u) -eq 0 ]] || skip "mounting a small tmpfs needs root"
e2e_init

MNT=$E2E_TMP/fs
mkdir -p "$MNT"
mount -t tmpfs -o size=4m tmpfs "$MNT" || fail "cannot mount a tmpfs on $MNT"
full_cleanup() {
    local rc=$?
    umount -l "$MNT" 2>/dev/null
    (exit "$rc")
    e2e_cleanup
}
trap full_cleanup EXIT
STORE=$MNT/store
export VDSTREAM_STORE=$STORE

# leftovers NAME — files in the vDisk's folder besides vdisk.json and what it lists.
leftovers() {
    vds vdisk info "$1" --json >"$E2E_TMP/info.json"
    python3 - "$E2E_TMP/info.json" "$STORE/vdisks/$1" <<'PY'
import json, os, sys
m = json.load(open(sys.argv[1]))["meta"]
listed = {m["base"]["file"], "vdisk.json"} | {v["file"] for v in m["versions"]} | set(m["retired"])
print(" ".join(sorted(set(os.listdir(sys.argv[2])) - listed)))
PY
}

vds vdisk create w --size 64M >/dev/null
v1=$(vds version new w --json | json_get /dev/stdin 'j["version"]["number"]')
vds version promote w "$v1" --to production >/dev/null

# Fill the file system to the last byte.
dd if=/dev/zero of="$MNT/filler" bs=4k status=none 2>/dev/null || true
rc=0
vds version new w >"$E2E_TMP/out" 2>"$E2E_TMP/err" || rc=$?
((rc != 0)) || fail "version new on a full file system succeeded"
grep -Eq "No space left on device" "$E2E_TMP/err" || fail "the error does not say the file system is full: $(cat "$E2E_TMP/err")"
log "ok: version new refused: $(head -c 200 "$E2E_TMP/err")"
left=$(leftovers w)
[[ -z $left ]] || fail "the failed version new left files behind: $left"
log "ok: nothing left behind by the failed version new"

# An import that does not fit leaves no staging folder and no vDisk.
truncate -s 8M "$E2E_TMP/big.raw"
dd if=/dev/urandom of="$E2E_TMP/big.raw" bs=1M count=8 conv=notrunc status=none
rc=0
vds vdisk import big "$E2E_TMP/big.raw" >/dev/null 2>"$E2E_TMP/err" || rc=$?
((rc != 0)) || fail "an import larger than the free space succeeded"
[[ $(ls -A "$STORE/vdisks") == w ]] || fail "the failed import left something in the store: $(ls -A "$STORE/vdisks")"
log "ok: the failed import left nothing"

# With room again, the next version new works at once (nothing blocks it).
rm -f "$MNT/filler"
v2=$(vds version new w --json | json_get /dev/stdin 'j["version"]["number"]')
[[ -s $STORE/vdisks/w/w.$v2.qcow2 ]] || fail "version $v2 has no file"
qemu-img check -q "$STORE/vdisks/w/w.$v2.qcow2" || fail "version $v2 does not pass qemu-img check"
log "ok: version new works again (version $v2)"

# What a crash leaves: an unlisted layer file, a temporary file of a dead process, and an
# unlisted file still held open (a reader), which gc must keep.
dir=$STORE/vdisks/w
qemu-img create -q -f qcow2 "$dir/w.90.qcow2" 64M
dead=$(sh -c 'echo $$')
echo partial >"$dir/.w.91.qcow2.tmp-$dead"
qemu-img create -q -f qcow2 "$dir/w.92.qcow2" 64M
python3 -c 'import fcntl, sys, time
f = open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_SH); open(sys.argv[2], "w").close(); time.sleep(60)' \
    "$dir/w.92.qcow2" "$E2E_TMP/held" &
holder=$!
track_pid "$holder"
for _ in $(seq 100); do [[ -e $E2E_TMP/held ]] && break; sleep 0.1; done
[[ -e $E2E_TMP/held ]] || fail "the holder did not take its lock within 10 s"
echo keep >"$dir/notes.txt"
vds vdisk gc --json >"$E2E_TMP/gc.json"
gone=$(json_get "$E2E_TMP/gc.json" '" ".join(sorted(d["file"] for d in j))')
assert_eq "files gc deleted" "$gone" ".w.91.qcow2.tmp-$dead w.90.qcow2"
[[ -e $dir/w.92.qcow2 && -e $dir/notes.txt ]] || fail "gc deleted a held file or a file that is not a layer"
stop_pid "$holder" 5
wait "$holder" 2>/dev/null || true
vds vdisk gc >/dev/null
[[ ! -e $dir/w.92.qcow2 ]] || fail "gc kept the unlisted file once nobody held it"
[[ $(leftovers w) == notes.txt ]] || fail "leftovers after gc: $(leftovers w)"
vds audit w --json >"$E2E_TMP/audit.json"
grep -q '"vdisk.gc"' "$E2E_TMP/audit.json" || fail "gc is not audited"
log "ok: gc deleted the crash's leftovers and kept the held file until it was released"
log "PASS"
