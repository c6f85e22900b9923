#!/usr/bin/env bash
# Three agents with different cache types (ram-overflow, device-disk, device-ram) stream
# one vDisk from one vdstream server at the same time, each under fio with crc32c
# verification: all three finish with zero errors, and the server saw three sessions.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=server-lib.sh
source "$E2E_DIR/server-lib.sh"
# shellcheck source=agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
# shellcheck source=fio-verify.sh
source "$E2E_DIR/fio-verify.sh"
require fio nbdinfo
require_vdstream
e2e_init
store_init

golden_vdisk w 128
start_store_server --stats-file "$E2E_TMP/stats.json"
srv=$SOCK
declare -A uris
for spec in a:ram-overflow:16M b:device-disk: c:device-ram:96M; do
    IFS=: read -r id cache ram <<<"$spec"
    # --ram only for the RAM types (device-disk refuses it, as every command does).
    start_agent "$id" --server "$(xuri vdisk/w "$srv")" --cache "$cache" ${ram:+--ram "$ram"}
    uris[$id]=$URI
done

pids=()
for id in a b c; do
    URI=${uris[$id]} run_fio_verify "agent-$id" --rw=randrw --rwmixwrite=40 --bs=4k --size=48m --iodepth=8 \
        --rate_iops=1500 --number_ios=6000 &
    pids+=($!)
done
for p in "${pids[@]}"; do
    wait "$p" || fail "fio through an agent failed"
done
sessions=$(json_get "$E2E_TMP/stats.json" 'len(j["sessions"])')
assert_eq "sessions on the server" "$sessions" 3
for id in a b c; do
    desc=$(agent_status_get "$id" 'j["vdisk"]["description"]')
    [[ $desc == "vdisk/w@1 (production)" ]] || fail "agent $id reads $desc"
done
log "ok: three agents, three cache types, zero errors"
