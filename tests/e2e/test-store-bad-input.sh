#!/usr/bin/env bash
# Every bad input the store names is refused with a message that says what is wrong and
# what to do, and changes nothing: a missing store, bad names (path tricks, '@', '..',
# leading '-'), bad sizes, an unknown vDisk (the known ones are listed), a corrupt
# vdisk.json (file and line named), a missing version file (named, with qemu-img check),
# an unsupported import format, a bad --at, a second maintenance version, a second writer
# on the maintenance version (holder named) and a second connection to its server,
# promoting a version that has a writer.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
require qemu-img nbdinfo nbdsh
require_vdstream
e2e_init
store_init

# expect_error WHAT PATTERN CMD... — CMD fails and its stderr matches PATTERN (grep -E).
expect_error() {
    local what=$1 pattern=$2; shift 2
    local rc=0
    "$@" >"$E2E_TMP/out" 2>"$E2E_TMP/err" || rc=$?
    ((rc != 0)) || fail "$what: the command succeeded: $*"
    grep -Eq -- "$pattern" "$E2E_TMP/err" || fail "$what: stderr does not match '$pattern': $(cat "$E2E_TMP/err")"
    log "ok: $what refused: $(head -c 160 "$E2E_TMP/err")"
}

expect_error "no store" "no store at .*check --store or VDSTREAM_STORE" vds vdisk list
for bad in "../evil" "a/b" "-rf" ".hidden" "a..b" "w@1" "" "$(printf 'x%.0s' {1..65})"; do
    expect_error "name '$bad'" "invalid vDisk name.*a name is 1 to 64" \
        "$VDSTREAM_BIN" vdisk create --store "$STORE" --size 1M -- "$bad"
done
[[ ! -e $STORE/vdisks ]] || [[ -z $(ls -A "$STORE/vdisks") ]] || fail "a bad name left something in the store"
expect_error "size 12parsecs" "unknown unit.*K, M, G or T" vds vdisk create w --size 12parsecs
expect_error "size 1000 bytes" "multiple of 512.*K, M, G or T" vds vdisk create w --size 1000
vds vdisk create w --size 16M >/dev/null
expect_error "the same name twice" "already exists" vds vdisk create w --size 16M
expect_error "unknown vDisk" 'no vDisk named "nope".*known vDisks: w' vds vdisk info nope
expect_error "unknown version" "has no version 7" vds version promote w 7 --to test
expect_error "bad version ref" "not a version" vds vdisk export w@newest "$E2E_TMP/x.raw"
echo "not an image" >"$E2E_TMP/text.txt"
qemu-img create -q -f qed "$E2E_TMP/old.qed" 1M 2>/dev/null && \
    expect_error "unsupported format" "is a qed image: vdstream imports raw, qcow2, vhdx, vpc \(VHD\), vmdk and vdi" vds vdisk import q "$E2E_TMP/old.qed"
expect_error "import of a folder" "is not a file" vds vdisk import q "$E2E_TMP"
v=$(vds version new w --json | json_get /dev/stdin 'j["version"]["number"]')
expect_error "bad --at" "not a time.*RFC 3339" vds version promote w "$v" --to production --at tomorrow
expect_error "--at with test" "--at schedules a release to production" vds version promote w "$v" --to test --at +1h
expect_error "second maintenance version" "already has version $v in maintenance" vds version new w

start_server --vdisk w@maintenance --store "$STORE"
expect_error "second writer" "already has a writer \(pid $SERVER_PID" \
    "$VDSTREAM_BIN" serve-image --vdisk w@maintenance --store "$STORE" --socket "$E2E_TMP/second.sock"
[[ ! -e $E2E_TMP/second.sock ]] || fail "the refused server left its socket behind"
require_python_nbd
nbdsh_script "
import nbd
h2 = nbd.NBD()
try:
    h2.connect_uri('$URI')
    raise SystemExit('a second connection to the maintenance version was accepted')
except nbd.Error as e:
    assert 'policy' in str(e) or 'one writer' in str(e), str(e)
h.pwrite(b'x' * 512, 0)
"
log "ok: a second connection to the maintenance version is refused while the first writes"
expect_error "promote with a writer" "still open by its maintenance target.*pid $SERVER_PID" vds version promote w "$v" --to test
stop_server "$SERVER_PID" 15 || fail "the maintenance server did not stop cleanly"
vds version promote w "$v" --to test >/dev/null

mv "$STORE/vdisks/w/w.$v.qcow2" "$E2E_TMP/moved.qcow2"
expect_error "missing version file" "w\.$v\.qcow2 is missing.*qemu-img check" vds vdisk export w@test "$E2E_TMP/y.raw"
mv "$E2E_TMP/moved.qcow2" "$STORE/vdisks/w/w.$v.qcow2"

cp "$STORE/vdisks/w/vdisk.json" "$E2E_TMP/good.json"
sed -i '3s/.*/  "format_version": oops,/' "$STORE/vdisks/w/vdisk.json"
expect_error "corrupt vdisk.json" "vdisks/w/vdisk.json is corrupt \(line 3, column [0-9]+: .*restore it from backup or re-import" vds vdisk info w
expect_error "change of a corrupt vDisk" "vdisk.json is corrupt" vds version promote w "$v" --to production
cp "$E2E_TMP/good.json" "$STORE/vdisks/w/vdisk.json"
rm "$STORE/vdisks/w/vdisk.json"
expect_error "missing vdisk.json" "vdisk.json is missing" vds vdisk info w
cp "$E2E_TMP/good.json" "$STORE/vdisks/w/vdisk.json"
echo '{"format": "something else"' >"$STORE/store.json"
expect_error "corrupt store.json" "store.json is corrupt" vds vdisk list
