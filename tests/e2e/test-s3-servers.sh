#!/usr/bin/env bash
# Two vdstream servers on the same s3:// store (a real 3-node Garage cluster), cold
# caches, and an agent that lists both. Under fio (random reads and writes, crc32c
# verify; reads of pages not written yet come from the vDisk through a server and its
# chunk cache from Garage):
# - one Garage node is SIGKILLed mid-run,
# - then the server in use is SIGKILLed,
# and fio finishes with zero errors; the agent failed over once, to the other server.
# Both servers' chunk counters show GETs, and no chunk failed its checksum.
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
# shellcheck source=garage-lib.sh
source "$E2E_DIR/garage-lib.sh"
require fio nbdinfo
require_vdstream
e2e_init
store_init
garage_start
S3=s3://vdstream-test/farm

golden_vdisk w 128
"$VDSTREAM_BIN" store copy --from "$STORE" --to "$S3" >/dev/null
LOCAL=$STORE
STORE=$S3
start_store_server --object-cache "$E2E_TMP/cache-a" --object-cache-ram 32M --object-cache-disk 64M
pid_a=$SERVER_PID sock_a=$SOCK
start_store_server --object-cache "$E2E_TMP/cache-b" --object-cache-ram 32M --object-cache-disk 64M
sock_b=$SOCK
STORE=$LOCAL
start_agent s1 --server "$(xuri vdisk/w "$sock_a")" --server "$(xuri vdisk/w "$sock_b")" --cache ram-overflow --ram 16M

run_fio_verify s3 --rw=randrw --rwmixwrite=40 --bs=4k --size=96m --iodepth=16 \
    --rate_iops=3000 --number_ios=24000 &
fio_pid=$!
sleep 2
log "SIGKILL to Garage node 3"
garage_kill 3
sleep 2
log "SIGKILL to the server in use (pid $pid_a)"
kill -KILL "$pid_a"
wait "$fio_pid" || fail "fio through the agent failed across a Garage node kill and a server kill"
server_alive "$AGENT_PID" || fail "the agent died"
sleep 1.5
assert_eq "server in use after the kill" "$(agent_status_get s1 'j["server"]["endpoint"]')" "$(xuri vdisk/w "$sock_b")"
assert_eq "failovers" "$(agent_status_get s1 'j["server"]["failovers"]')" 1
sleep 2   # the chunk counters are written with every metadata refresh (2 s)
for c in a b; do
    stats=$E2E_TMP/cache-$c/vdstream-test/farm/object-stats.json
    [[ -s $stats ]] || fail "server $c wrote no chunk counters"
    gets=$(json_get "$stats" 'j["chunks"]["gets"]')
    corrupt=$(json_get "$stats" 'j["chunks"]["corrupt"]')
    ((gets > 0)) || fail "server $c made no GETs"
    assert_eq "chunks failing their checksum at server $c" "$corrupt" 0
    log "server $c: $gets GETs"
done
echo "PASS"
