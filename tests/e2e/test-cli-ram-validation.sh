#!/usr/bin/env bash
# One --ram validation for every command that takes it (serve-image, target add, target
# set, target attach, size, and the API's target records): the same size parser, the same
# range (0, or 1M to 256G) and the same rule per cache type, with the same message; a
# cache on this machine also may not exceed its RAM. Every refusal exits 2 (usage).
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=api-lib.sh
source "$E2E_DIR/api-lib.sh"
require curl
require_vdstream
e2e_init
store_init
V=$VDSTREAM_BIN
export VDSTREAM_RUN_DIR=$E2E_TMP/run VDSTREAM_CACHE_DIR=$E2E_TMP/cache

# refused PATTERN ARGS... — `vdstream ARGS` exits 2 at once with PATTERN on stderr.
refused() {
    local pattern=$1 rc=0; shift
    timeout 30 "$V" "$@" >"$E2E_TMP/out.txt" 2>"$E2E_TMP/err.txt" </dev/null || rc=$?
    [[ $rc == 2 ]] || fail "vdstream $*: status $rc, want 2: $(cat "$E2E_TMP/out.txt" "$E2E_TMP/err.txt")"
    grep -Eq -- "$pattern" "$E2E_TMP/err.txt" || fail "vdstream $*: stderr lacks /$pattern/: $(cat "$E2E_TMP/err.txt")"
    log "ok: refused: vdstream ${*:1:3} ... ($(grep -Eo -- "$pattern" "$E2E_TMP/err.txt" | head -n1))"
}

vds vdisk create w --size 1M >/dev/null
vds target add vm1 --vdisk w --cache device-ram --ram 64M >/dev/null
nbd="nbd+unix:///?socket=$E2E_TMP/nobody.sock"
for bad in 1 4096 1023K; do
    for cmd in "target add vm2 --vdisk w --cache device-ram --store $STORE" "target set vm1 --store $STORE" \
        "target attach t1 --server $nbd --cache ram-overflow" "serve-image --memory 1M --cache ram-overflow" \
        "size --trace $E2E_TMP/none.trace"; do
        # shellcheck disable=SC2086 # cmd is a list of words
        refused "RAM .* is too small for a write cache: give at least 1M" $cmd --ram "$bad"
    done
done
for bad in 1T 257G 1P; do
    for cmd in "target add vm2 --vdisk w --cache device-ram --store $STORE" "target attach t1 --server $nbd" \
        "serve-image --memory 1M --cache device-ram" "size --trace $E2E_TMP/none.trace"; do
        # shellcheck disable=SC2086
        refused "at most 256G" $cmd --ram "$bad"
    done
done
refused "is not a whole number of bytes" target add vm2 --vdisk w --cache device-ram --ram 1.0000001M --store "$STORE"

# The per-type rule, with the same words for a record and for an attach.
why="--ram is for the device-ram and ram-overflow cache types, not device-disk"
refused "$why" target add vm2 --vdisk w --cache device-disk --ram 64M --store "$STORE"
refused "$why" target attach t1 --server "$nbd" --cache device-disk --ram 64M
refused "$why" serve-image --memory 1M --cache device-disk --ram 64M
refused "device-ram with --ram 0 could hold no write" target attach t1 --server "$nbd" --cache device-ram --ram 0

# More RAM than this machine has, for a cache on this machine (a record may be for another).
mem=$(($(awk '/^MemTotal:/ {print $2}' /proc/meminfo) * 1024))
if ((mem + (1 << 30) <= 256 << 30)); then
    over="$(((mem >> 30) + 1))G"
    refused "more than this machine has" target attach t1 --server "$nbd" --cache ram-overflow --ram "$over"
    refused "more than this machine has" serve-image --memory 1M --cache ram-overflow --ram "$over"
    vds target add big --vdisk w --cache ram-overflow --ram "$over" >/dev/null || fail "a record for a bigger machine was refused"
fi

# The API's records take the same range.
start_api
out=$(api POST /api/v1/targets '{"id": "vm3", "vdisk": "w", "cache": "device-ram", "ram": 1}')
[[ ${out##*$'\n'} == 400 ]] || fail "the API took ram 1: $out"
grep -q "too small for a write cache" <<<"$out" || fail "the API's refusal does not say why: $out"
log "ok: the API refuses ram 1 with the same words"

# What is in range is taken.
vds target set vm1 --ram 1M >/dev/null || fail "--ram 1M refused"
vds target add vm4 --vdisk w --cache ram-overflow --ram 0 >/dev/null || fail "--ram 0 refused for ram-overflow"
vds target add vm5 --vdisk w --cache device-ram --ram 1.5G >/dev/null || fail "--ram 1.5G refused"
assert_eq "vm5's RAM" "$(vds target show vm5 --json | json_get /dev/stdin 'j["ram"]')" $((3 << 29))
