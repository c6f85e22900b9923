#!/usr/bin/env bash
# A store on a real 3-node Garage cluster (replication factor 3):
# - `vdstream store copy` moves a store with a base and two versions up to s3://, and a
#   second run sends nothing; back down, every layer file is byte-identical and
#   `qemu-img compare` finds the chain the same;
# - `vdstream server --store s3://…` serves each version, and what qemu-img reads from it
#   equals what a server on the local folder serves; promotes made in the bucket reach it
#   without a restart; its metadata cannot be changed through it;
# - one Garage node SIGKILLed: a cold server's reads all succeed and match;
# - bad input: wrong credentials (exit 2, "refused the credentials"), a missing bucket
#   (exit 3), an object damaged in place (a chunk failing its CRC-32C is an I/O error
#   for the guest and a line in the server's log, never data; the other chunks serve).
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=server-lib.sh
source "$E2E_DIR/server-lib.sh"
# shellcheck source=garage-lib.sh
source "$E2E_DIR/garage-lib.sh"
require qemu-img nbdinfo
require_vdstream
e2e_init
store_init
garage_start
S3=s3://vdstream-test/farm

# A 48 MiB vDisk: 40 MiB random, 8 MiB of zeros at the end (never sent), two versions.
head -c $((40 << 20)) /dev/urandom >"$E2E_TMP/g.img"
truncate -s 48M "$E2E_TMP/g.img"
vds vdisk import golden "$E2E_TMP/g.img" >/dev/null
v1=$(new_patched_version golden production 1M 256k 0x11)
v2=$(new_patched_version golden test 5M 64k 0x22)
log "local store: golden base, v$v1 production, v$v2 test"

up=$("$VDSTREAM_BIN" store copy --from "$STORE" --to "$S3" --json)
layers=$(json_get /dev/stdin 'j["layers"]' <<<"$up")
moved=$(json_get /dev/stdin 'j["bytes_moved"]' <<<"$up")
assert_eq "layers copied up" "$layers" 3
# The 8 MiB of zeros and nothing else is left out of the base.
base_bytes=$(stat -c %s "$STORE/vdisks/golden/golden.base.raw")
[[ $moved -lt $((base_bytes)) && $moved -gt $((40 << 20)) ]] || fail "bytes sent $moved: expected the 40 MiB of data plus the versions, not the zeros ($base_bytes in the base file)"
again=$("$VDSTREAM_BIN" store copy --from "$STORE" --to "$S3" --json)
assert_eq "layers skipped on a second copy" "$(json_get /dev/stdin 'j["layers_skipped"]' <<<"$again")" 3
assert_eq "bytes sent on a second copy" "$(json_get /dev/stdin 'j["bytes_moved"]' <<<"$again")" 0

# Down again, resuming a copy that stopped halfway through the base (its first 20 MiB
# are in place as golden.base.raw.part): only the rest is fetched.
mkdir -p "$E2E_TMP/back/vdisks/golden"
head -c $((20 << 20)) "$STORE/vdisks/golden/golden.base.raw" >"$E2E_TMP/back/vdisks/golden/golden.base.raw.part"
down=$("$VDSTREAM_BIN" store copy --from "$S3" --to "$E2E_TMP/back" --json)
fetched=$(json_get /dev/stdin 'j["bytes_moved"]' <<<"$down")
versions=$(($(stat -c %s "$STORE/vdisks/golden/golden.$v1.qcow2") + $(stat -c %s "$STORE/vdisks/golden/golden.$v2.qcow2")))
((fetched >= (20 << 20) && fetched <= (20 << 20) + versions)) ||
    fail "the resumed copy fetched $fetched bytes: want the base's last 20 MiB of data plus at most the versions ($versions)"
log "a resumed copy fetched $fetched bytes (the base's missing 20 MiB and the versions)"
# Byte-identical layers, and the same chain.
for f in "$STORE"/vdisks/golden/golden.*; do
    cmp "$f" "$E2E_TMP/back/vdisks/golden/$(basename "$f")" || fail "$(basename "$f") differs after the round trip"
done
top=$(ls "$STORE"/vdisks/golden/golden.$v2.qcow2)
qemu-img compare -q "$top" "$E2E_TMP/back/vdisks/golden/golden.$v2.qcow2" || fail "qemu-img compare: the copied chain differs"
"$VDSTREAM_BIN" version list golden --store "$E2E_TMP/back" >/dev/null || fail "the copied-down store does not open"

# The local server and the S3 server serve the same bytes.
start_store_server
local_sock=$SOCK
STORE_SAVED=$STORE
STORE=$S3 start_store_server --object-cache "$E2E_TMP/objcache" --object-cache-ram 16M --object-cache-disk 32M
s3_sock=$SOCK; s3_pid=$SERVER_PID; s3_log=$SERVER_LOG
STORE=$STORE_SAVED
for exp in "vdisk/golden" "vdisk/golden@$v1" "vdisk/golden@$v2" "vdisk/golden@base"; do
    qemu-img convert -f raw -O raw "$(xuri "$exp" "$local_sock")" "$E2E_TMP/local.raw"
    qemu-img convert -f raw -O raw "$(xuri "$exp" "$s3_sock")" "$E2E_TMP/s3.raw"
    cmp "$E2E_TMP/local.raw" "$E2E_TMP/s3.raw" || fail "$exp: the S3 server's bytes differ from the local store's"
done
log "four exports read the same from the S3 store and the local one"

# Changes through the mirror are refused; a promote copied up reaches the server.
out=$("$VDSTREAM_BIN" version promote golden "$v2" --to production --store "$E2E_TMP/objcache/vdstream-test/farm" 2>&1) && fail "a promote in the mirror was taken"
grep -q "mirror of a store in object storage" <<<"$out" || fail "the refusal does not say why: $out"
vds version promote golden "$v2" --to production >/dev/null
"$VDSTREAM_BIN" store copy --from "$STORE" --to "$S3" >/dev/null
qemu-img convert -f raw -O raw "$(xuri vdisk/golden "$local_sock")" "$E2E_TMP/local.raw"
deadline=$((SECONDS + 15))
until qemu-img convert -f raw -O raw "$(xuri vdisk/golden "$s3_sock")" "$E2E_TMP/s3.raw" && cmp -s "$E2E_TMP/local.raw" "$E2E_TMP/s3.raw"; do
    ((SECONDS < deadline)) || fail "the promote made in the bucket did not reach the S3 server in 15 s"
    sleep 0.5
done
log "a promote copied up was served within $((SECONDS - deadline + 15)) s"

# A vDisk deleted and imported again under the same name (its layer files get the same
# names): a running S3 server that had read and cached the old one serves the new bytes,
# never the old chunks. Then, deleted while the server is down: the restarted server on
# the same --object-cache no longer lists it.
head -c $((6 << 20)) /dev/urandom >"$E2E_TMP/other-a.img"
head -c $((6 << 20)) /dev/urandom >"$E2E_TMP/other-b.img"
vds vdisk import other "$E2E_TMP/other-a.img" >/dev/null
"$VDSTREAM_BIN" store copy --from "$STORE" --to "$S3" >/dev/null
deadline=$((SECONDS + 15))
until qemu-img convert -f raw -O raw "$(xuri vdisk/other "$s3_sock")" "$E2E_TMP/other.raw" 2>/dev/null; do
    ((SECONDS < deadline)) || fail "vdisk/other did not reach the S3 server in 15 s"
    sleep 0.5
done
cmp "$E2E_TMP/other.raw" "$E2E_TMP/other-a.img" || fail "vdisk/other: not the bytes imported"
vds vdisk delete other >/dev/null
vds vdisk import other "$E2E_TMP/other-b.img" >/dev/null
"$VDSTREAM_BIN" store copy --from "$STORE" --to "$S3" >/dev/null
deadline=$((SECONDS + 15))
until qemu-img convert -f raw -O raw "$(xuri vdisk/other "$s3_sock")" "$E2E_TMP/other.raw" 2>/dev/null && cmp -s "$E2E_TMP/other.raw" "$E2E_TMP/other-b.img"; do
    ((SECONDS < deadline)) || fail "after a new import under the same name, the S3 server still serves other bytes (old chunks?)"
    sleep 0.5
done
log "a vDisk imported again under its name: the running S3 server serves the new bytes"
stop_server "$s3_pid" 10 || fail "the S3 server did not stop cleanly"
vds vdisk delete other >/dev/null
"$VDSTREAM_BIN" store copy --from "$STORE" --to "$S3" >/dev/null
STORE=$S3 start_store_server_on "$s3_sock" --object-cache "$E2E_TMP/objcache" --object-cache-ram 16M --object-cache-disk 32M
s3_pid=$SERVER_PID
STORE=$STORE_SAVED
nbdinfo --list "nbd+unix:///?socket=$s3_sock" >"$E2E_TMP/list.txt"
grep -q "vdisk/other" "$E2E_TMP/list.txt" && fail "a vDisk deleted while the server was down is still listed after its restart"
grep -q "vdisk/golden" "$E2E_TMP/list.txt" || fail "the restarted server does not list vdisk/golden"
log "a vDisk deleted while the server was down is gone after its restart"

# A store copy refuses a layer a maintenance target is writing (it would not be sealed,
# and could change under the upload).
vds version new golden >/dev/null
start_server --vdisk golden@maintenance --store "$STORE"
maint_pid=$SERVER_PID
rc=0; out=$("$VDSTREAM_BIN" store copy --from "$STORE" --to "$S3" 2>&1) || rc=$?
assert_eq "exit status of a copy while a maintenance target writes" "$rc" 2
grep -q "is open for writing (a maintenance target of vDisk golden)" <<<"$out" || fail "the refusal does not say why: $out"
stop_server "$maint_pid" 10 || fail "the maintenance server did not stop cleanly"

# One Garage node killed (not the one whose S3 port the servers use), then a fresh server
# reads everything cold. (test-s3-servers.sh kills a node in the middle of an fio run.)
STORE=$S3 start_store_server --object-cache "$E2E_TMP/objcache2" --object-cache-ram 8M --object-cache-disk 0
cold_sock=$SOCK
STORE=$STORE_SAVED
garage_kill 3
qemu-img convert -f raw -O raw "$(xuri "vdisk/golden@$v1" "$cold_sock")" "$E2E_TMP/cold.raw" || fail "a read failed with one Garage node down"
qemu-img convert -f raw -O raw "$(xuri "vdisk/golden@$v1" "$local_sock")" "$E2E_TMP/local.raw"
cmp "$E2E_TMP/local.raw" "$E2E_TMP/cold.raw" || fail "bytes read with a Garage node down differ"
log "reads with one of three Garage nodes killed: whole and equal"

# The store goes away mid-read (every Garage node stopped): a read of a chunk not in the
# cache gets EIO after the stated timeout (VDSTREAM_S3_TIMEOUT=4), not before and not
# never; when the store comes back, the same read succeeds.
VDSTREAM_S3_TIMEOUT=4 STORE=$S3 start_store_server --object-cache "$E2E_TMP/objcache5" --object-cache-ram 8M --object-cache-disk 0
away_sock=$SOCK
STORE=$STORE_SAVED
# One NBD connection, open before the store goes away (opening an export reads its
# layers' indexes, so a connection made while the store is away is refused at once).
"$PY" - "$(xuri vdisk/golden@base "$away_sock")" "${GARAGE_PIDS[@]}" >"$E2E_TMP/away.out" 2>&1 <<'PYEOF' || fail "store away: $(cat "$E2E_TMP/away.out")"
import os, signal, sys, time
import nbd
h = nbd.NBD()
h.connect_uri(sys.argv[1])
h.pread(4096, 0)                      # chunk 0 (and its read-ahead) now cached
pids = [int(p) for p in sys.argv[2:]]
for p in pids:
    try: os.kill(p, signal.SIGSTOP)
    except ProcessLookupError: pass   # node 3 was killed above
t0 = time.monotonic()
try:
    h.pread(4096, 30 << 20)           # chunk 30: not cached
    err = None
except nbd.Error as e:
    err = e
waited = time.monotonic() - t0
for p in pids:
    try: os.kill(p, signal.SIGCONT)
    except ProcessLookupError: pass
assert err is not None, "a read of an uncached chunk succeeded with the store stopped"
assert err.errnum == 5, f"want EIO, got {err}"
assert 3.5 <= waited <= 30, f"EIO after {waited:.1f} s; the stated timeout is 4 s"
h.pread(4096, 30 << 20)               # the store is back: the same read succeeds
print(f"{waited:.1f}")
PYEOF
waited=$(tail -n1 "$E2E_TMP/away.out")
log "store away: EIO after ${waited}s (timeout 4 s); the same read succeeds once it is back"

# A layer in the bucket whose qcow2 header names a backing file outside its folder
# (/etc/hostname here) is refused when opened, never served: whoever can write the bucket
# cannot make a server read its own files.
evil=$E2E_TMP/store-evil
head -c $((2 << 20)) /dev/urandom >"$E2E_TMP/evil.img"
"$VDSTREAM_BIN" vdisk import evil "$E2E_TMP/evil.img" --store "$evil" >/dev/null
"$VDSTREAM_BIN" version new evil --store "$evil" >/dev/null
"$VDSTREAM_BIN" version promote evil 1 --to production --store "$evil" >/dev/null
qemu-img rebase -u -b /etc/hostname -F raw "$evil/vdisks/evil/evil.1.qcow2"
"$VDSTREAM_BIN" store copy --from "$evil" --to s3://vdstream-test/evil >/dev/null
# (started by hand: the usual readiness check lists the exports, and this one's fails)
"$VDSTREAM_BIN" server --store s3://vdstream-test/evil --socket "$E2E_TMP/evil.sock" --object-cache "$E2E_TMP/objcache-evil" \
    --object-cache-ram 8M --object-cache-disk 0 >"$E2E_TMP/evil.log" 2>&1 &
track_pid "$!"
deadline=$((SECONDS + 20))
until [[ -S $E2E_TMP/evil.sock ]]; do ((SECONDS < deadline)) || fail "the server of the evil store did not start"; sleep 0.1; done
qemu-img convert -f raw -O raw "$(xuri vdisk/evil "$E2E_TMP/evil.sock")" "$E2E_TMP/evil.raw" 2>/dev/null && fail "a layer backed by /etc/hostname was served"
grep -q 'its header names backing file "/etc/hostname", but the layer recorded below it is' "$E2E_TMP/evil.log" ||
    fail "the server's log does not say why the layer was refused"
log "a layer whose backing file is outside its folder is refused"

# Wrong credentials, missing bucket.
rc=0; out=$(AWS_SECRET_ACCESS_KEY=${AWS_SECRET_ACCESS_KEY/0/1} "$VDSTREAM_BIN" store copy --from "$S3" --to "$E2E_TMP/x" 2>&1) || rc=$?
assert_eq "exit status with a wrong secret" "$rc" 2
grep -q "refused the credentials" <<<"$out" || fail "wrong secret: $out"
rc=0; out=$("$VDSTREAM_BIN" store copy --from "$STORE" --to s3://no-such-bucket/x 2>&1) || rc=$?
assert_eq "exit status with a missing bucket" "$rc" 3
grep -q "does not exist" <<<"$out" || fail "missing bucket: $out"
rc=0; AWS_SECRET_ACCESS_KEY=${AWS_SECRET_ACCESS_KEY/0/1} "$VDSTREAM_BIN" server --store "$S3" --socket "$E2E_TMP/bad.sock" \
    --object-cache "$E2E_TMP/objcache3" >"$E2E_TMP/bad.log" 2>&1 || rc=$?
assert_eq "server exit status with a wrong secret" "$rc" 2
grep -q "refused the credentials" "$E2E_TMP/bad.log" || fail "server with a wrong secret: $(cat "$E2E_TMP/bad.log")"

# The same server from a config file, the AWS variables unset: the file's s3-* keys reach
# the store.
cat >"$E2E_TMP/server.toml" <<EOF
store = "$S3"
object-cache = "$E2E_TMP/objcache6"
object-cache-ram = "8M"
object-cache-disk = 0
s3-endpoint = "$AWS_ENDPOINT_URL"
s3-region = "garage"
s3-access-key-id = "$AWS_ACCESS_KEY_ID"
s3-secret-access-key = "$AWS_SECRET_ACCESS_KEY"
EOF
env -u AWS_ENDPOINT_URL -u AWS_REGION -u AWS_ACCESS_KEY_ID -u AWS_SECRET_ACCESS_KEY \
    "$VDSTREAM_BIN" server --config "$E2E_TMP/server.toml" --socket "$E2E_TMP/conf.sock" >"$E2E_TMP/conf.log" 2>&1 &
conf_pid=$!
track_pid "$conf_pid"
wait_ready "$conf_pid" "nbd+unix:///vdisk/golden?socket=$E2E_TMP/conf.sock"
qemu-img convert -f raw -O raw "$(xuri vdisk/golden "$E2E_TMP/conf.sock")" "$E2E_TMP/conf.raw"
qemu-img convert -f raw -O raw "$(xuri vdisk/golden "$local_sock")" "$E2E_TMP/local.raw"
cmp "$E2E_TMP/conf.raw" "$E2E_TMP/local.raw" || fail "the server configured by its file serves other bytes"
stop_server "$conf_pid" 10 || fail "the configured server did not stop cleanly"
log "a server whose store and credentials come from its config file serves the same bytes"

# An object damaged in place: one byte of the base's chunk 20 flipped, the index kept.
obj=vdisks/golden/golden.base.raw
"$PY" - "$E2E_TMP/flip" "$STORE/$obj" <<'PYEOF'
import sys
data = bytearray(open(sys.argv[2], "rb").read()[: 40 << 20])   # the stored (non-zero) chunks
data[(20 << 20) + 5] ^= 0xff
open(sys.argv[1], "wb").write(data)
PYEOF
# s3req METHOD KEY [BODY-FILE] — one request signed with SigV4 as any S3 client signs it
# (the body of a GET on stdout).
s3req() {
    "$PY" - "$@" <<'PYEOF'
import datetime, hashlib, hmac, os, sys, urllib.request
method, key = sys.argv[1], sys.argv[2]
body = open(sys.argv[3], "rb").read() if len(sys.argv) > 3 else b""
ep = os.environ["AWS_ENDPOINT_URL"]; host = ep.split("//")[1]
now = datetime.datetime.now(datetime.timezone.utc)
amz, day = now.strftime("%Y%m%dT%H%M%SZ"), now.strftime("%Y%m%d")
ph = hashlib.sha256(body).hexdigest()
path = "/vdstream-test/" + key
creq = f"{method}\n{path}\n\nhost:{host}\nx-amz-content-sha256:{ph}\nx-amz-date:{amz}\n\nhost;x-amz-content-sha256;x-amz-date\n{ph}"
scope = f"{day}/garage/s3/aws4_request"
sts = f"AWS4-HMAC-SHA256\n{amz}\n{scope}\n" + hashlib.sha256(creq.encode()).hexdigest()
k = ("AWS4" + os.environ["AWS_SECRET_ACCESS_KEY"]).encode()
for part in (day, "garage", "s3", "aws4_request"):
    k = hmac.new(k, part.encode(), hashlib.sha256).digest()
sig = hmac.new(k, sts.encode(), hashlib.sha256).hexdigest()
auth = f"AWS4-HMAC-SHA256 Credential={os.environ['AWS_ACCESS_KEY_ID']}/{scope}, SignedHeaders=host;x-amz-content-sha256;x-amz-date, Signature={sig}"
req = urllib.request.Request(ep + path, data=body if method == "PUT" else None, method=method,
                             headers={"x-amz-date": amz, "x-amz-content-sha256": ph, "Authorization": auth})
sys.stdout.buffer.write(urllib.request.urlopen(req).read())
PYEOF
}
# The index names the data object; the damaged bytes go over that object.
object=$(s3req GET "farm/$obj.idx" | json_get /dev/stdin 'j["object"]')
s3req PUT "farm/vdisks/golden/$object" "$E2E_TMP/flip" >/dev/null
STORE=$S3 start_store_server --object-cache "$E2E_TMP/objcache4" --object-cache-ram 8M --object-cache-disk 0
bad_sock=$SOCK; bad_log=$SERVER_LOG
STORE=$STORE_SAVED
# The damaged chunk's guest range fails; the export's other chunks serve.
rc=0; qemu-io -f raw -r -c "read 20M 4k" "$(xuri vdisk/golden@base "$bad_sock")" >"$E2E_TMP/bad.err" 2>&1 || rc=$?
grep -qi "input/output error" "$E2E_TMP/bad.err" || fail "a read of the damaged chunk did not get EIO (status $rc): $(cat "$E2E_TMP/bad.err")"
qemu-io -f raw -r -c "read -P 0 44M 1M" "$(xuri vdisk/golden@base "$bad_sock")" >/dev/null || fail "a read of a zero chunk failed beside the damaged one"
qemu-io -f raw -r -c "read 0 1M" -c "read 21M 1M" "$(xuri vdisk/golden@base "$bad_sock")" >/dev/null || fail "reads of good chunks failed beside the damaged one"
grep -q "fails its checksum" "$bad_log" || fail "the server's log does not name the damaged chunk"
grep -q "$object: chunk 20" "$bad_log" || fail "the server's log does not name the damaged object ($object) and chunk"
log "a damaged chunk: EIO to the guest, named in the log, never served"
echo "PASS"
