#!/usr/bin/env bash
# serve-image on the top of a qcow2 version chain (raw base, qcow2 layers with data, zero
# clusters, discards, compressed clusters and mixed cluster sizes) serves exactly what
# `qemu-img convert` reads from the chain, and its block status agrees with qemu-img map
# on what reads as zeros. A writable qcow2 serve writes only the top layer.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require qemu-img qemu-io nbdcopy
require_vdstream
e2e_init

d=$E2E_TMP
qemu-img create -q -f raw "$d/base.raw" 32M
qemu-io -f raw -c 'write -P 0x11 0 8M' -c 'write -P 0x12 20M 4M' "$d/base.raw" >/dev/null
qemu-img create -q -f qcow2 -b base.raw -F raw "$d/v1.qcow2"
qemu-io -f qcow2 -c 'write -P 0x21 1M 300k' -c 'write -z 4M 1M' -c 'discard 21M 128k' \
    -c 'write -c -P 0x22 26M 64k' "$d/v1.qcow2" >/dev/null
qemu-img create -q -f qcow2 -o cluster_size=4096 -b v1.qcow2 -F qcow2 "$d/v2.qcow2"
qemu-io -f qcow2 -c 'write -P 0x31 4M 5000' -c 'write -z 0 12k' -c 'write -P 0x32 31M 1M' "$d/v2.qcow2" >/dev/null
qemu-img create -q -f qcow2 -b v2.qcow2 -F qcow2 "$d/v3.qcow2" 40M
qemu-io -f qcow2 -c 'write -P 0x41 35M 64k' -c 'write -z 1M 64k' "$d/v3.qcow2" >/dev/null
qemu-img convert -O raw "$d/v3.qcow2" "$d/want.raw"

# The chain is ours, so we say its format: a probed qcow2 may not name a backing file.
rc=0
"$VDSTREAM_BIN" serve-image --read-only --socket "$d/auto.sock" "$d/v3.qcow2" >"$d/auto.log" 2>&1 || rc=$?
[[ $rc -ne 0 ]] || fail "serve-image --format auto served a probed qcow2 that names a backing file"
grep -q 'names backing file "v2.qcow2"' "$d/auto.log" && grep -q -- "--format qcow2" "$d/auto.log" ||
    fail "the refusal does not name the backing file and say --format qcow2: $(cat "$d/auto.log")"
start_server --read-only --format qcow2 "$d/v3.qcow2"
grep -q "qcow2 image" "$SERVER_LOG" || fail "server did not open the image as qcow2: $(cat "$SERVER_LOG")"
assert_eq "size" "$(nbdinfo --size "$URI")" $((40 * 1024 * 1024))
run_bounded 60 nbdcopy "$URI" "$d/got.raw"
cmp "$d/want.raw" "$d/got.raw" || fail "served content differs from qemu-img convert of the chain"
log "ok: served content equals qemu-img convert -O raw of the chain"

# Zero flags: ours (through NBD block status) against qemu's own reading of the chain.
qemu-img map --output=json "$d/v3.qcow2" >"$d/qemu-map.json"
qemu-img map --output=json -f raw "$URI" >"$d/nbd-map.json"
"$PY" - "$d/qemu-map.json" "$d/nbd-map.json" <<'PYEOF' || fail "zero map differs"
import json, sys
def zeros(path):
    out = []
    for e in json.load(open(path)):
        if e["zero"]:
            if out and out[-1][1] == e["start"]:
                out[-1][1] = e["start"] + e["length"]
            else:
                out.append([e["start"], e["start"] + e["length"]])
    return out
a, b = zeros(sys.argv[1]), zeros(sys.argv[2])
print("qemu zero ranges:", a, file=sys.stderr)
print("nbd  zero ranges:", b, file=sys.stderr)
sys.exit(a != b)
PYEOF
log "ok: zero ranges agree with qemu-img map"
stop_server "$SERVER_PID" || fail "server did not stop cleanly"

# Writable: writes land in the top layer only; the layers below are unchanged.
sums=$(md5sum "$d/base.raw" "$d/v1.qcow2" "$d/v2.qcow2")
start_server --format qcow2 "$d/v3.qcow2"
qemu-io -f raw -c 'write -P 0x51 2M 64k' "$URI" >/dev/null
stop_server "$SERVER_PID" || fail "server did not stop cleanly"
[[ $(md5sum "$d/base.raw" "$d/v1.qcow2" "$d/v2.qcow2") == "$sums" ]] || fail "a lower layer changed"
qemu-img check -q "$d/v3.qcow2" || fail "qemu-img check found problems in the written top layer"
qemu-io -f qcow2 -c 'read -P 0x51 2M 64k' "$d/v3.qcow2" | grep -q "read 65536" || fail "the write is not in v3"
log "ok: a writable serve writes v3 only, and qemu reads the write back"
