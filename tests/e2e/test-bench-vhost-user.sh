#!/usr/bin/env bash
# `vdstream bench vhost-user:PATH` against a real vhost-user-blk backend, qemu-storage-daemon
# exporting a raw scratch file with 4 queues: the VDI profile with --verify runs 4 workers x
# QD 16 through it, with IOPS, no error and no mismatch over checked reads, and its writes
# are in the backend's file at the offsets their stamps name (so the data went through the
# backend, not around it); the vhost-user:///ABS/PATH form works too. Clear errors and a
# nonzero exit for: more workers than the backend has queues, writes to a read-only export
# (which --write-pct 0 then reads), a path with no socket, and a socket nobody listens on.
# `vdstream bench in-process:ram-overflow` runs the same workload on the write-cache engine
# in this process (a RAM base of --working-set), also overflowing a small --ram with
# --verify clean, and leaves nothing in TMPDIR; an unknown cache type is a usage error.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require qemu-storage-daemon
require_vdstream
e2e_init
bench() { run_bounded 60 "$VDSTREAM_BIN" bench "$@"; }

# start_qsd NAME WRITABLE — qemu-storage-daemon exporting $E2E_TMP/NAME.img as a
# vhost-user-blk device (4 queues, writable=WRITABLE) on $E2E_TMP/NAME.vhost; waits for
# the socket. Sets QSD_PID and QSD_SOCK.
start_qsd() {
    local name=$1 writable=$2 read_only=on i
    [[ $writable == on ]] && read_only=off
    QSD_SOCK=$E2E_TMP/$name.vhost
    local log=$E2E_TMP/$name.qsd.log
    qemu-storage-daemon \
        --blockdev "driver=file,node-name=file0,filename=$E2E_TMP/$name.img,read-only=$read_only" \
        --export "type=vhost-user-blk,id=exp0,node-name=file0,addr.type=unix,addr.path=$QSD_SOCK,writable=$writable,num-queues=4" \
        >"$log" 2>&1 &
    QSD_PID=$!
    track_pid "$QSD_PID"
    E2E_SERVER_LOGS+=("$log")
    for ((i = 0; i < 100; i++)); do
        [[ -S $QSD_SOCK ]] && return 0
        kill -0 "$QSD_PID" 2>/dev/null || fail "qemu-storage-daemon exited: $(cat "$log")"
        sleep 0.1
    done
    fail "qemu-storage-daemon made no socket $QSD_SOCK in 10 s: $(cat "$log")"
}

# expect_error WHAT PATTERN ARGS... — bench ARGS fails with a message matching PATTERN.
expect_error() {
    local what=$1 pattern=$2 out rc=0; shift 2
    out=$(bench "$@" 2>&1) || rc=$?
    ((rc != 0)) || fail "$what: bench succeeded: $out"
    [[ $out =~ $pattern ]] || fail "$what: unclear error: $out"
    log "ok: $what (exit $rc): $out"
}

truncate -s 256M "$E2E_TMP/rw.img"
start_qsd rw on
bench "vhost-user:$QSD_SOCK" --duration 3 --verify --json >"$E2E_TMP/vu.json" || fail "bench vhost-user --verify failed: $(cat "$E2E_TMP/vu.json")"
"$PY" - "$E2E_TMP/vu.json" <<'PYEOF' || fail "the vhost-user result: $(cat "$E2E_TMP/vu.json")"
import json, sys
j = json.load(open(sys.argv[1]))
w, t, r, wr, v = j["workload"], j["total"], j["read"], j["write"], j["verify"]
assert (w["workers"], w["queue_depth"], w["block_size"], w["write_pct"]) == (4, 16, 4096, 80), w
assert t["iops"] > 0 and r["ops"] > 0 and wr["ops"] > 0 and t["ops"] == r["ops"] + wr["ops"], (t, r, wr)
assert 0.70 < wr["ops"] / t["ops"] < 0.90, ("write share", wr["ops"] / t["ops"])
assert j["errors"] == 0, j["error_messages"]
assert v["mismatches"] == 0 and v["checked_reads"] > 0, v
assert j["export_size"] == 256 << 20 and j["working_set"] == 256 << 20, j
assert len(j["series"]) >= 2 and all(s["read_iops"] + s["write_iops"] > 0 for s in j["series"]), j["series"]
l = t["latency"]
assert 0 < l["p50_us"] <= l["p99_us"] <= l["max_us"], l
print(f"vhost-user: {t['iops']:.0f} IOPS, mean {l['mean_us']} us, p99 {l['p99_us']} us, {v['checked_reads']} reads checked")
PYEOF
log "ok: the VDI profile with --verify through qemu-storage-daemon"

# The writes are in the backend's file: every 16-byte stamp (offset, "VDSB", generation)
# there names its own offset in the file.
"$PY" - "$E2E_TMP/rw.img" <<'PYEOF' || fail "the backend's file does not hold the benchmark's writes"
import struct, sys
data = open(sys.argv[1], "rb").read()
stamps = wrong = 0
for pos in range(0, len(data), 4096):
    if data[pos + 8:pos + 12] != b"VDSB":
        continue
    stamps += 1
    for s in range(pos, pos + 4096, 16):
        off, magic = struct.unpack_from("<Q4s", data, s)
        if magic != b"VDSB" or off != s:
            wrong += 1
            break
assert stamps > 1000 and wrong == 0, (stamps, wrong)
print(f"{stamps} stamped blocks in the image, each at the offset it names")
PYEOF
log "ok: the writes reached the backend's file at their offsets"

bench "vhost-user://$QSD_SOCK" --duration 1 --workers 2 --queue-depth 4 --write-pct 0 --json >"$E2E_TMP/abs.json" || fail "vhost-user:///ABS/PATH failed: $(cat "$E2E_TMP/abs.json")"
assert_eq "the vhost-user:///ABS/PATH form's reads" "$(json_get "$E2E_TMP/abs.json" 'j["read"]["ops"] > 0 and j["write"]["ops"] == 0 and j["errors"] == 0')" True
expect_error "more workers than the backend's queues" "offers 4 queue.*--workers 4 or fewer" "vhost-user:$QSD_SOCK" --workers 5 --duration 1
stop_pid "$QSD_PID"

truncate -s 64M "$E2E_TMP/ro.img"
start_qsd ro off
expect_error "writes to a read-only export" "vhost-user:$QSD_SOCK is read-only.*--write-pct 0" "vhost-user:$QSD_SOCK" --duration 1
bench "vhost-user:$QSD_SOCK" --duration 1 --write-pct 0 --json >"$E2E_TMP/ro.json" || fail "reads of a read-only export failed: $(cat "$E2E_TMP/ro.json")"
assert_eq "reads of a read-only export" "$(json_get "$E2E_TMP/ro.json" 'j["total"]["iops"] > 0 and j["errors"] == 0')" True
stop_pid "$QSD_PID"

nobody=$E2E_TMP/nobody.vhost
expect_error "a path with no socket" "cannot benchmark vhost-user:$nobody: no socket at $nobody.*backend running" "vhost-user:$nobody" --duration 1
"$PY" -c 'import socket, sys; s = socket.socket(socket.AF_UNIX); s.bind(sys.argv[1]); s.close()' "$E2E_TMP/stale.vhost"
expect_error "a socket nobody listens on" "nothing listens on $E2E_TMP/stale.vhost" "vhost-user:$E2E_TMP/stale.vhost" --duration 1

mkdir "$E2E_TMP/tmp"
TMPDIR=$E2E_TMP/tmp bench in-process:ram-overflow --working-set 256M --duration 2 --json >"$E2E_TMP/ip.json" || fail "bench in-process:ram-overflow failed: $(cat "$E2E_TMP/ip.json")"
"$PY" - "$E2E_TMP/ip.json" <<'PYEOF' || fail "the in-process result: $(cat "$E2E_TMP/ip.json")"
import json, sys
j = json.load(open(sys.argv[1]))
t = j["total"]
assert j["uri"] == "in-process:ram-overflow" and j["export_size"] == 256 << 20 and j["working_set"] == 256 << 20, j
assert t["iops"] > 0 and j["read"]["ops"] > 0 and j["write"]["ops"] > 0 and j["errors"] == 0, j
print(f"in-process ram-overflow: {t['iops']:.0f} IOPS, mean {t['latency']['mean_us']} us")
PYEOF
log "ok: in-process:ram-overflow"
# 16 MiB of RAM for a 256 MiB working set: the cache overflows to its file, and reads
# still return the last write.
TMPDIR=$E2E_TMP/tmp bench in-process:ram-overflow --working-set 256M --ram 16M --duration 2 --verify --json >"$E2E_TMP/ov.json" ||
    fail "bench in-process:ram-overflow --ram 16M --verify failed: $(cat "$E2E_TMP/ov.json")"
assert_eq "an overflowing in-process cache's verify" "$(json_get "$E2E_TMP/ov.json" 'j["verify"]["checked_reads"] > 0 and j["verify"]["mismatches"] == 0 and j["errors"] == 0')" True
left=$(find "$E2E_TMP/tmp" -mindepth 1 | head -n 3)
[[ -z $left ]] || fail "in-process runs left files in TMPDIR: $left"
rc=0
out=$(bench in-process:nosuch --duration 1 2>&1) || rc=$?
if ((rc != 2)) || [[ ! $out =~ unknown\ cache\ type.*ram-overflow ]]; then
    fail "an unknown in-process cache: exit $rc, want 2 (usage) and the cache types: $out"
fi
log "ok: an unknown in-process cache type (exit 2): $out"
