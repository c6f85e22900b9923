#!/usr/bin/env bash
# A store in object storage changed as a store folder is (a real 3-node Garage cluster):
# - `vdstream server --store s3://… --metadata-writer` makes the store in an empty bucket;
#   a second server on the bucket is a mirror;
# - the same steps run on the s3:// store (through `--store s3://…` on the writer's host,
#   the maintenance target writing through the writer's `maintenance/NAME` export, a
#   promote sent to the mirror's API, which forwards it to the writer) and on a local
#   store folder: import, version new, edit, promote, a second version, merge, export.
#   `qemu-img compare` finds the exports equal, and the mirror serves the same bytes;
# - two servers racing to promote on the same generation: one wins, the other gets a
#   conflict (exit 4, 412), and the winner's change is the one in the bucket;
# - a second --metadata-writer is refused while the first is alive (exit 4);
# - from another host (a UTS namespace with another host name) `--store s3://…` sends
#   the commands the API serves to the writer, and refuses the others with the writer's
#   host named;
# - with the writer stopped, a change sent to the mirror is 503 naming the writer, and
#   nothing changes; the writer restarted on its folder resumes;
# - a copy into a bucket whose writer is alive is refused (exit 4); a store copied into
#   a new prefix gets a writer that fetches its layers, and a version made, written,
#   promoted and merged there exports the same as on the local folder;
# - a token made on the writer's host reaches the mirror (its API closes), and a change
#   sent to the mirror with it is made by the writer and audited under the token's name.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=server-lib.sh
source "$E2E_DIR/server-lib.sh"
# shellcheck source=garage-lib.sh
source "$E2E_DIR/garage-lib.sh"
require qemu-img qemu-io nbdinfo nbdcopy curl unshare
require_vdstream
e2e_init
store_init
garage_start
S3=s3://vdstream-test/farm
LOCAL=$STORE

read -r port_a port_b port_c <<<"$("$PY" -c 'import socket
s=[socket.socket() for _ in range(3)]
[x.bind(("127.0.0.1",0)) for x in s]
print(*[x.getsockname()[1] for x in s])')"
A=http://127.0.0.1:$port_a
B=http://127.0.0.1:$port_b

STORE=$S3
start_store_server --metadata-writer --http "127.0.0.1:$port_a" --object-cache "$E2E_TMP/cache-a" --object-cache-ram 32M --object-cache-disk 0
pid_a=$SERVER_PID sock_a=$SOCK log_a=$SERVER_LOG
grep -q "made an empty one" "$log_a" || fail "the writer did not make the store in the empty bucket"
start_store_server --http "127.0.0.1:$port_b" --object-cache "$E2E_TMP/cache-b" --object-cache-ram 32M --object-cache-disk 0
sock_b=$SOCK
STORE=$LOCAL

s3() { "$VDSTREAM_BIN" "$@" --store "$S3"; }
loc() { "$VDSTREAM_BIN" "$@" --store "$LOCAL"; }

# wait_generation NAME GEN URL — the server at URL reports NAME at generation GEN (bounded).
wait_generation() {
    local deadline=$((SECONDS + 20)) got
    while ((SECONDS < deadline)); do
        got=$(curl -sf --max-time 5 "$3/api/v1/vdisks/$1/versions" | json_get /dev/stdin 'j["generation"]' 2>/dev/null || true)
        [[ $got == "$2" ]] && return 0
        sleep 0.3
    done
    fail "the server at $3 did not reach generation $2 of $1 within 20 s (it has ${got:-nothing})"
}

make_sparse_image "$E2E_TMP/src.img" 40

log "the same steps on the s3:// store and on a local folder"
s3 vdisk import g "$E2E_TMP/src.img" >/dev/null
loc vdisk import g "$E2E_TMP/src.img" >/dev/null
[[ -f $E2E_TMP/cache-a/vdstream-test/farm/vdisks/g/vdisk.json ]] || fail "--store s3:// on the writer's host did not work in the writer's folder"

v1=$(s3 version new g --json | json_get /dev/stdin 'j["version"]["number"]')
assert_eq "first version on the local store" "$(loc version new g --json | json_get /dev/stdin 'j["version"]["number"]')" "$v1"
# The maintenance target writes through the writer's maintenance/g export.
qemu-io -f raw -c "write -P 0x31 1M 256k" -c "write -P 0x32 17M 64k" "$(xuri maintenance/g "$sock_a")" >/dev/null || fail "writing maintenance/g through the writer failed"
store_qemu_io g -c "write -P 0x31 1M 256k" -c "write -P 0x32 17M 64k"
# The promote goes to the mirror, which sends it to the writer.
"$VDSTREAM_BIN" version promote g "$v1" --to production --server "$B" >/dev/null || fail "a promote sent to the mirror failed"
grep -q "sent to the metadata writer $A: 200" "$E2E_TMP/server1.log" || fail "the mirror's log does not say it forwarded the promote"
loc version promote g "$v1" --to production >/dev/null

v2=$(s3 version new g --json | json_get /dev/stdin 'j["version"]["number"]')
loc version new g >/dev/null
qemu-io -f raw -c "write -P 0x41 30M 1M" "$(xuri maintenance/g "$sock_a")" >/dev/null || fail "writing v$v2 through the writer failed"
store_qemu_io g -c "write -P 0x41 30M 1M"
s3 version promote g "$v2" --to production >/dev/null
loc version promote g "$v2" --to production >/dev/null
s3 version merge g >/dev/null
loc version merge g >/dev/null

gen=$(s3 version list g --json | json_get /dev/stdin 'j["generation"]')
wait_generation g "$gen" "$B"
log "the mirror has generation $gen of g"

s3 vdisk export g@production "$E2E_TMP/s3.qcow2" --format qcow2 >/dev/null
loc vdisk export g@production "$E2E_TMP/local.qcow2" --format qcow2 >/dev/null
qemu-img compare "$E2E_TMP/s3.qcow2" "$E2E_TMP/local.qcow2" >/dev/null || fail "the s3:// store's export differs from the local store's"
nbdcopy "$(xuri vdisk/g "$sock_b")" "$E2E_TMP/mirror.raw" || fail "reading vdisk/g from the mirror failed"
qemu-img compare -f raw "$E2E_TMP/mirror.raw" "$E2E_TMP/local.qcow2" >/dev/null || fail "the mirror serves other bytes than the local store"
log "ok: export from s3:// = export from the local folder = what the mirror serves"
gets=$(curl -sf "$B/metrics" | awk '/^vdstream_object_gets_total /{print $2}')
fetched=$(curl -sf "$B/metrics" | awk '/^vdstream_object_get_bytes_total /{print $2}')
corrupt=$(curl -sf "$B/metrics" | awk '/^vdstream_object_corrupt_total /{print $2}')
((gets > 0 && fetched >= gets)) || fail "the mirror's /metrics shows no chunk GETs after serving g (gets=$gets bytes=$fetched)"
assert_eq "chunks failing their checksum in the mirror's /metrics" "$corrupt" 0

log "two servers racing to promote on the same generation"
v3=$(s3 version new g --json | json_get /dev/stdin 'j["version"]["number"]')
qemu-io -f raw -c "write -P 0x51 2M 64k" "$(xuri maintenance/g "$sock_a")" >/dev/null
g3=$(s3 version list g --json | json_get /dev/stdin 'j["generation"]')
wait_generation g "$g3" "$B"
set +e
"$VDSTREAM_BIN" version promote g "$v3" --to test --expect-generation "$g3" --server "$A" --json >"$E2E_TMP/race-a.json" 2>&1 &
ra=$!
"$VDSTREAM_BIN" version revert g "$v3" --expect-generation "$g3" --server "$B" --json >"$E2E_TMP/race-b.json" 2>&1 &
rb=$!
wait "$ra"; ea=$?
wait "$rb"; eb=$?
set -e
log "promote through the writer: exit $ea; revert through the mirror: exit $eb"
if ((ea == 0 && eb == 4)); then
    winner="test"
    grep -q "changed since generation $g3" "$E2E_TMP/race-b.json" || fail "the loser's error does not name the conflict: $(cat "$E2E_TMP/race-b.json")"
elif ((ea == 4 && eb == 0)); then
    winner="discarded"
    grep -q "changed since generation $g3" "$E2E_TMP/race-a.json" || fail "the loser's error does not name the conflict: $(cat "$E2E_TMP/race-a.json")"
else
    fail "want one change to win and the other to get a conflict (exit 4); got exits $ea and $eb"
fi
wait_generation g $((g3 + 1)) "$B"
state=$(curl -sf "$B/api/v1/vdisks/g/versions" | json_get /dev/stdin "next((v['access'] for v in j['versions'] if v['number'] == $v3), 'discarded')")
assert_eq "version $v3 as the mirror reads it from the bucket" "$state" "$winner"
# The GET names the generation (ETag); an If-Match of an older one is refused through the mirror too.
curl -sf -o /dev/null -D "$E2E_TMP/etag.txt" "$A/api/v1/vdisks/g/versions"
grep -qi "^etag: \"$((g3 + 1))\"" "$E2E_TMP/etag.txt" || fail "the vDisk's GET has no ETag of its generation: $(cat "$E2E_TMP/etag.txt")"
code=$(curl -s -o "$E2E_TMP/412.json" -w '%{http_code}' -X POST -H 'Content-Type: application/json' -H "If-Match: \"$g3\"" --data '{"base": false}' "$B/api/v1/vdisks/g/merge")
assert_eq "a merge sent with an old If-Match through the mirror" "$code" 412

log "a second metadata writer is refused"
set +e
"$VDSTREAM_BIN" server --store "$S3" --metadata-writer --http 127.0.0.1:1 --socket "$E2E_TMP/second.sock" --object-cache "$E2E_TMP/cache-c" >"$E2E_TMP/second.log" 2>&1 </dev/null &
second=$!
for _ in $(seq 100); do kill -0 "$second" 2>/dev/null || break; sleep 0.1; done
kill -0 "$second" 2>/dev/null && { kill "$second"; fail "a second --metadata-writer started"; }
wait "$second"; rc=$?
set -e
assert_eq "exit status of a second writer" "$rc" 4
grep -q "has a metadata writer already: the server at $A" "$E2E_TMP/second.log" || fail "the second writer's error does not name the first: $(cat "$E2E_TMP/second.log")"

log "from another host: the API's commands go to the writer; the others name its host"
other() { unshare --uts sh -c 'hostname vds-elsewhere && exec "$@"' sh "$@"; }
other "$VDSTREAM_BIN" version list g --store "$S3" --json >"$E2E_TMP/remote-list.json" || fail "version list from another host failed"
assert_eq "generation read from another host" "$(json_get "$E2E_TMP/remote-list.json" 'j["generation"]')" $((g3 + 1))
other "$VDSTREAM_BIN" audit g --store "$S3" --json >"$E2E_TMP/remote-audit.json" || fail "audit from another host failed"
# v1 and v2 were promoted, and v3 if the promote won the race (a refused change is not audited).
assert_eq "promotes of g in the audit trail read from another host" \
    "$(json_get "$E2E_TMP/remote-audit.json" 'sum(1 for e in j if e["action"] == "version.promote")')" "$([[ $winner == test ]] && echo 3 || echo 2)"
set +e
other "$VDSTREAM_BIN" vdisk import h "$E2E_TMP/src.img" --store "$S3" >"$E2E_TMP/remote-import.txt" 2>&1
rc=$?
set -e
assert_eq "exit status of an import from another host" "$rc" 2
grep -q "run it on $(hostname)" "$E2E_TMP/remote-import.txt" || fail "the refusal does not name the writer's host: $(cat "$E2E_TMP/remote-import.txt")"

log "the writer stops: a change through the mirror is refused and changes nothing"
kill -TERM "$pid_a"
wait "$pid_a" 2>/dev/null || true
code=$(curl -s -o "$E2E_TMP/503.json" -w '%{http_code}' -X POST -H 'Content-Type: application/json' --data '{}' "$B/api/v1/vdisks/g/versions")
assert_eq "a change through the mirror with no writer" "$code" 503
grep -q "metadata writer" "$E2E_TMP/503.json" || fail "the 503 does not say what is missing: $(cat "$E2E_TMP/503.json")"
STORE=$S3
start_store_server --metadata-writer --http "127.0.0.1:$port_a" --object-cache "$E2E_TMP/cache-a" --object-cache-ram 32M --object-cache-disk 0
STORE=$LOCAL
grep -q "was its metadata writer before" "$SERVER_LOG" || fail "the restarted writer did not resume its folder"
assert_eq "generation after the restart" "$(s3 version list g --json | json_get /dev/stdin 'j["generation"]')" $((g3 + 1))
"$VDSTREAM_BIN" version new g --server "$B" >/dev/null || fail "a change through the mirror failed once the writer was back"

log "a token made on the writer works on the mirror, which forwards it"
tok=$(s3 token add ops --role admin 2>/dev/null)
deadline=$((SECONDS + 20))
until [[ $(curl -s -o /dev/null -w '%{http_code}' "$B/api/v1/vdisks") == 401 ]]; do
    ((SECONDS < deadline)) || fail "the mirror's API is still open 20 s after a token was made on the writer"
    sleep 0.3
done
code=$(curl -s -o /dev/null -w '%{http_code}' -X POST -H 'Content-Type: application/json' --data '{"version": 1}' "$B/api/v1/vdisks/g/revert")
assert_eq "a change without the token through the mirror" "$code" 401
VDSTREAM_TOKEN=$tok "$VDSTREAM_BIN" version revert g "$((v3 + 1))" --server "$B" >/dev/null || fail "a change with the writer's token through the mirror failed"
# The mirror's audit trail is the writer's, published and read again within seconds.
deadline=$((SECONDS + 20))
until VDSTREAM_TOKEN=$tok "$VDSTREAM_BIN" audit g --server "$B" --json | grep -q "token:ops"; do
    ((SECONDS < deadline)) || fail "the audit trail does not name the token of the forwarded change 20 s later"
    sleep 0.5
done

log "a store copy into a bucket with a live writer is refused"
set +e
"$VDSTREAM_BIN" store copy --from "$LOCAL" --to "$S3" >"$E2E_TMP/copy-live.txt" 2>&1
rc=$?
set -e
assert_eq "exit status of a copy into a store with a live writer" "$rc" 4
grep -q "has a live metadata writer" "$E2E_TMP/copy-live.txt" || fail "the refusal does not say why: $(cat "$E2E_TMP/copy-live.txt")"

log "a store copied up: its writer fetches the layers, and versions and merges work there"
C=s3://vdstream-test/copied
"$VDSTREAM_BIN" store copy --from "$LOCAL" --to "$C" >/dev/null
STORE=$C
start_store_server --metadata-writer --http "127.0.0.1:$port_c" --object-cache "$E2E_TMP/cache-w2" --object-cache-ram 32M --object-cache-disk 0
sock_c=$SOCK
STORE=$LOCAL
grep -q "fetched [0-9]* layer(s)" "$SERVER_LOG" || fail "the writer of a copied store did not fetch its layers"
vc=$("$VDSTREAM_BIN" version new g --store "$C" --json | json_get /dev/stdin 'j["version"]["number"]')
qemu-io -f raw -c "write -P 0x61 3M 128k" "$(xuri maintenance/g "$sock_c")" >/dev/null || fail "writing maintenance/g of the copied store failed"
"$VDSTREAM_BIN" version promote g "$vc" --to production --store "$C" >/dev/null
"$VDSTREAM_BIN" version merge g --store "$C" >/dev/null
vl=$(loc version new g --json | json_get /dev/stdin 'j["version"]["number"]')
store_qemu_io g -c "write -P 0x61 3M 128k"
loc version promote g "$vl" --to production >/dev/null
loc version merge g >/dev/null
"$VDSTREAM_BIN" vdisk export g@production "$E2E_TMP/c.qcow2" --format qcow2 --store "$C" >/dev/null
loc vdisk export g@production "$E2E_TMP/l2.qcow2" --format qcow2 >/dev/null
qemu-img compare "$E2E_TMP/c.qcow2" "$E2E_TMP/l2.qcow2" >/dev/null || fail "the copied store's export differs from the local store's after the same steps"
log "ok: the copied store's writer made, promoted and merged a version like the local folder"
echo "PASS"
