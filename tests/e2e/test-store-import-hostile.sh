#!/usr/bin/env bash
# An image from outside is data: `vdisk import` of an image whose metadata names another
# file (a qcow2 backing file by path, json: spec or nbd:// address; a VMDK descriptor's
# flat extent, padded to fit; a VMDK delta's parent) is refused before qemu-img opens it,
# with an error that names what the image named and how to import a chain. The host file
# the images name carries a unique marker: it never reaches the store, and no connection
# reaches the nbd:// address. A qcow2 chain given explicitly with --version imports, each
# child checked to back onto the file given before it.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
require qemu-img
require_vdstream
e2e_init
store_init

host_secret 1

# A TCP listener standing for the nbd:// server an image names: it records any connection.
hits=$E2E_TMP/nbd-hits
"$PY" - "$hits" >"$E2E_TMP/listener.port" <<'EOF' &
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", 0)); s.listen(8)
print(s.getsockname()[1], flush=True)
s.settimeout(120)
try:
    while True:
        c, _ = s.accept()
        open(sys.argv[1], "a").write("connection\n")
        c.close()
except Exception:
    pass
EOF
track_pid $!
for ((i = 0; i < 100; i++)); do [[ -s $E2E_TMP/listener.port ]] && break; sleep 0.1; done
[[ -s $E2E_TMP/listener.port ]] || fail "the listener did not start"
port=$(cat "$E2E_TMP/listener.port")

# refused NAME FILE WANT — `vdisk import NAME FILE` fails with exit status 2 (bad input),
# its message names WANT and says how to import a chain, and no vDisk NAME exists.
refused() {
    local name=$1 file=$2 want=$3 rc=0
    vds vdisk import "$name" "$file" >"$E2E_TMP/out" 2>"$E2E_TMP/err" || rc=$?
    [[ $rc -eq 2 ]] || fail "importing $file: exit status $rc, want 2 (bad input); stderr: $(cat "$E2E_TMP/err")"
    grep -qF -- "$want" "$E2E_TMP/err" || fail "importing $file: the error does not name $want: $(cat "$E2E_TMP/err")"
    grep -qF -- "--version" "$E2E_TMP/err" || grep -qF "import the disk itself" "$E2E_TMP/err" ||
        fail "importing $file: the error does not say how to import it instead: $(cat "$E2E_TMP/err")"
    if vds vdisk info "$name" >/dev/null 2>&1; then fail "vDisk $name exists after a refused import"; fi
    log "refused as it should: $(basename "$file") ($want)"
}

# 1. qcow2 backing files: a host path, a json: spec, an nbd:// address.
qemu-img create -q -f qcow2 -u -F raw -b "$secret" "$E2E_TMP/path.qcow2" 1M
refused path "$E2E_TMP/path.qcow2" "\"$secret\""
qemu-img create -q -f qcow2 -u -F raw -b "json:{\"file\":{\"driver\":\"file\",\"filename\":\"$secret\"}}" "$E2E_TMP/json.qcow2" 1M
refused json "$E2E_TMP/json.qcow2" "json:"
qemu-img create -q -f qcow2 -u -F raw -b "nbd://127.0.0.1:$port/x" "$E2E_TMP/nbd.qcow2" 1M
refused nbd "$E2E_TMP/nbd.qcow2" "nbd://127.0.0.1:$port/x"

# 2. A monolithicFlat VMDK descriptor whose extent is the host file (8 sectors, inside its
# size, so that a size check passes), padded to a whole sector.
{
    printf '# Disk DescriptorFile\nversion=1\nCID=fffffffe\nparentCID=ffffffff\ncreateType="monolithicFlat"\n\n'
    printf '# Extent description\nRW 8 FLAT "%s" 0\n\n' "$secret"
    printf '# The Disk Data Base\nddb.virtualHWVersion = "4"\nddb.geometry.cylinders = "1"\nddb.geometry.heads = "16"\nddb.geometry.sectors = "63"\nddb.adapterType = "ide"\n'
} >"$E2E_TMP/flat.vmdk"
truncate -s 4096 "$E2E_TMP/flat.vmdk"
refused flat "$E2E_TMP/flat.vmdk" "\"$secret\""

# 3. A VMDK delta whose descriptor names its parent (qemu-img's own parentFileNameHint).
qemu-img convert -q -f raw -O vmdk "$secret" "$E2E_TMP/parent.vmdk"
qemu-img create -q -f vmdk -b "$E2E_TMP/parent.vmdk" -F vmdk "$E2E_TMP/delta.vmdk"
refused delta "$E2E_TMP/delta.vmdk" "parent \"$E2E_TMP/parent.vmdk\""

# Nothing of the host file reached the store, and nobody dialled the nbd:// address.
if [[ -d $STORE ]] && grep -rqF "$marker" "$STORE"; then fail "the host file's marker is in the store"; fi
[[ ! -e $hits ]] || fail "an import connected to the nbd:// address an image named"

# A chain given explicitly: a raw base and two qcow2 children, each backing onto the one
# before it by a relative name; version N serves exactly what qemu reads through the chain.
make_sparse_image "$E2E_TMP/base.raw" 8
qemu-img create -q -f qcow2 -F raw -b base.raw "$E2E_TMP/c1.qcow2"
qemu-io -f qcow2 -c 'write -P 0x11 0 64k' -c 'write -z 1M 512k' "$E2E_TMP/c1.qcow2" >/dev/null
qemu-img create -q -f qcow2 -F qcow2 -b c1.qcow2 "$E2E_TMP/c2.qcow2"
qemu-io -f qcow2 -c 'write -P 0x22 32k 64k' "$E2E_TMP/c2.qcow2" >/dev/null
vds vdisk import chain "$E2E_TMP/base.raw" --version "$E2E_TMP/c1.qcow2" --version "$E2E_TMP/c2.qcow2" >"$E2E_TMP/out" 2>&1 ||
    fail "importing the qcow2 chain with --version failed: $(cat "$E2E_TMP/out")"
qemu-img convert -f qcow2 -O raw "$E2E_TMP/c2.qcow2" "$E2E_TMP/want.raw"
served_raw chain "$E2E_TMP/got.raw"
cmp "$E2E_TMP/want.raw" "$E2E_TMP/got.raw" || fail "the imported qcow2 chain serves other bytes than qemu reads through it"
assert_eq "versions of the imported chain" "$(vds version list chain --json | json_get /dev/stdin 'len(j["versions"])')" 2

# A child given out of order (c2 directly on the base) is refused, naming its parent check.
rc=0
vds vdisk import chain2 "$E2E_TMP/base.raw" --version "$E2E_TMP/c2.qcow2" >"$E2E_TMP/out" 2>&1 || rc=$?
[[ $rc -ne 0 ]] || fail "a qcow2 child whose backing file is not the file before it was imported"
grep -q "is not a child of" "$E2E_TMP/out" || fail "the refusal does not say the child does not fit: $(cat "$E2E_TMP/out")"
log "ok"
