#!/usr/bin/env bash
# Where the store is, and how errors read:
# - `--store s3://bucket/prefix` (and VDSTREAM_STORE=s3://…): the store commands look for
#   the store's metadata writer there, so without credentials they say which variables to
#   set; `serve-image` is refused, naming what it works on and what serves and changes an
#   s3:// store; `server` without credentials says which variables to set. None creates
#   anything (no folder `s3:` in the working directory) (test-s3-writer runs them on a
#   real store);
#   `file:///PATH` is the folder PATH;
# - an OS error is said once: "No such file or directory" does not repeat itself.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
require_vdstream
e2e_init
store_init

work=$E2E_TMP/cwd
mkdir -p "$work"
cd "$work"

# refused WHAT CMD... — CMD fails, says what a store may be, and leaves $work empty.
refused() {
    local what=$1 rc=0; shift
    "$@" >"$E2E_TMP/out" 2>"$E2E_TMP/err" || rc=$?
    ((rc != 0)) || fail "$what: the command succeeded: $*"
    grep -q "${WANT:-this command works on a local folder, given as a path (/srv/vdstream) or as file:///srv/vdstream .*an s3:// store is served by \`vdstream server --store s3://BUCKET/PREFIX\`, changed by the one started with --metadata-writer (and by the commands on its host), and filled by \`vdstream store copy\`}" "$E2E_TMP/err" ||
        fail "$what: the error does not name the schemes served: $(cat "$E2E_TMP/err")"
    [[ -z $(ls -A "$work") ]] || fail "$what: something was created in the working directory: $(ls -A "$work")"
    log "ok: $what refused (exit $rc): $(cat "$E2E_TMP/err")"
}

NOCRED="s3://bucket/prefix: no credentials; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
noenv=(env -u AWS_ACCESS_KEY_ID -u AWS_SECRET_ACCESS_KEY)
WANT=$NOCRED refused "--store s3:// on create" "${noenv[@]}" "$VDSTREAM_BIN" vdisk create w --size 1M --store s3://bucket/prefix
WANT=$NOCRED refused "--store s3:// on list" "${noenv[@]}" "$VDSTREAM_BIN" vdisk list --store s3://bucket/prefix
WANT=$NOCRED refused "--store s3:// on target list" "${noenv[@]}" "$VDSTREAM_BIN" target list --store s3://bucket/prefix
WANT=$NOCRED refused "VDSTREAM_STORE=s3:// on import" "${noenv[@]}" env VDSTREAM_STORE=s3://bucket/prefix "$VDSTREAM_BIN" vdisk import w /etc/hostname
refused "--store s3:// on serve-image" "$VDSTREAM_BIN" serve-image --vdisk w --store s3://bucket/prefix --socket "$E2E_TMP/s.sock"
WANT=$NOCRED \
    refused "--store s3:// on server without credentials" "${noenv[@]}" \
    timeout 10 "$VDSTREAM_BIN" server --store s3://bucket/prefix --socket "$E2E_TMP/s.sock" --object-cache "$work/objects"

# file:///PATH is the folder PATH.
"$VDSTREAM_BIN" vdisk create w --size 1M --store "file://$STORE" >/dev/null
[[ -f $STORE/vdisks/w/vdisk.json ]] || fail "--store file://$STORE did not make the store at $STORE"
[[ -z $(ls -A "$work") ]] || fail "file:// created something in the working directory: $(ls -A "$work")"
vds vdisk info w >/dev/null
log "ok: file://$STORE is the folder $STORE"

# An OS error reads once.
rc=0
vds vdisk export w "$E2E_TMP/no/such/dir/w.raw" 2>"$E2E_TMP/err" || rc=$?
((rc != 0)) || fail "export into a missing folder succeeded"
n=$(grep -o "No such file or directory" "$E2E_TMP/err" | wc -l)
assert_eq "times the OS error is said ($(cat "$E2E_TMP/err"))" "$n" 1
grep -q "no/such/dir/w.raw" "$E2E_TMP/err" || fail "the error does not name the file: $(cat "$E2E_TMP/err")"
log "PASS"
