#!/usr/bin/env bash
# The shared read cache: 8 clients read the same 32 MiB vDisk at once; the server's
# guest reads are 8× the disk while its store reads (what reached the layer files) stay
# about 1× (figures from --stats-file, written at exit). With --read-cache 0 the store
# is read once per client.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=server-lib.sh
source "$E2E_DIR/server-lib.sh"
require nbdcopy nbdinfo
require_vdstream
e2e_init
store_init

MIB=32 N=8
golden_vdisk w $MIB

read_all() { # STATS-FILE SERVER-ARGS... — N concurrent full reads, then stop the server
    local stats=$1 pids=() p i; shift
    start_store_server --stats-file "$stats" "$@"
    for ((i = 0; i < N; i++)); do
        run_bounded 120 nbdcopy "$(xuri vdisk/w)" null: &
        pids+=($!)
    done
    for p in "${pids[@]}"; do
        wait "$p" || fail "a reader failed"
    done
    stop_server "$SERVER_PID" 15 || fail "the server did not stop cleanly"
}

read_all "$E2E_TMP/cached.json"
guest=$(json_get "$E2E_TMP/cached.json" 'j["totals"]["guest_read_bytes"]')
store=$(json_get "$E2E_TMP/cached.json" 'j["totals"]["store_read_bytes"]')
shared=$(json_get "$E2E_TMP/cached.json" 'j["read_cache"]["shared_loads"]')
log "read cache on: guest reads $((guest >> 20)) MiB, store reads $((store >> 20)) MiB ($shared loads shared)"
((guest >= N * (MIB << 20))) || fail "guest reads $guest < $N × $MIB MiB"
((store <= (MIB << 20) * 5 / 4)) || fail "store reads $store > 1.25 × $MIB MiB: the cache did not share"
((store >= (MIB << 20) * 9 / 10)) || fail "store reads $store < 0.9 × $MIB MiB: store reads are not counted"

read_all "$E2E_TMP/off.json" --read-cache 0
store=$(json_get "$E2E_TMP/off.json" 'j["totals"]["store_read_bytes"]')
log "read cache off: store reads $((store >> 20)) MiB"
((store >= N * (MIB << 20) * 9 / 10)) || fail "without the cache, store reads $store < $N × $MIB MiB"
