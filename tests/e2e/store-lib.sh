# shellcheck shell=bash
# tests/e2e/store-lib.sh — helpers for the test-store-*.sh tests (source after lib.sh).
#
#   vds ARGS...              run `vdstream ARGS... --store $STORE`
#   store_write NAME OFF LEN PATTERN
#                            write a qemu-io pattern through a served maintenance version
#   new_patched_version NAME TO OFF LEN PATTERN
#                            version new + store_write + promote --to TO; prints the number

STORE=
store_init() {
    STORE=$E2E_TMP/store
    export VDSTREAM_STORE=$STORE
}

vds() { "$VDSTREAM_BIN" "$@" --store "$STORE"; }

# qemu-io COMMAND on the maintenance version of NAME, served by vdstream for this call.
store_qemu_io() {
    local name=$1; shift
    start_server --vdisk "$name@maintenance" --store "$STORE"
    local pid=$SERVER_PID
    qemu-io -f raw "$@" "$URI" >/dev/null || fail "qemu-io $* on $name@maintenance failed"
    stop_server "$pid" 15 || fail "the maintenance server of $name did not stop cleanly"
}

new_patched_version() {
    local name=$1 to=$2 off=$3 len=$4 pat=$5 v
    v=$(vds version new "$name" --json | json_get /dev/stdin 'j["version"]["number"]')
    store_qemu_io "$name" -c "write -P $pat $off $len" >&2
    vds version promote "$name" "$v" --to "$to" >/dev/null
    echo "$v"
}

# served_raw REF OUT — what serve-image serves for REF, copied to a raw file.
served_raw() {
    start_server --vdisk "$1" --store "$STORE" --read-only
    local pid=$SERVER_PID
    qemu-img convert -f raw -O raw "$URI" "$2" || fail "reading $1 over NBD failed"
    stop_server "$pid" 15 || fail "the server of $1 did not stop cleanly"
}
