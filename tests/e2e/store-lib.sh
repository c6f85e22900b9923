# shellcheck shell=bash
# tests/e2e/store-lib.sh — helpers for the test-store-*.sh tests (source after lib.sh).
#
#   vds ARGS...              run `vdstream ARGS... --store $STORE`
#   store_write NAME OFF LEN PATTERN
#                            write a qemu-io pattern through a served maintenance version
#   new_patched_version NAME TO OFF LEN PATTERN
#                            version new + store_write + promote --to TO; prints the number
#   host_secret MIB          a host file an attacker wants, $E2E_TMP/secret, with the unique
#                            text $marker in every 4 KiB of MIB MiB (sets secret, marker)

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

# snapshot_refs NAME DIR REF... — what each REF of NAME serves over NBD, into DIR/REF.raw.
snapshot_refs() {
    local name=$1 dir=$2 ref; shift 2
    mkdir -p "$dir"
    for ref in "$@"; do
        served_raw "$name@$ref" "$dir/$ref.raw"
    done
}

# same_refs BEFORE AFTER REF... — each REF serves the same bytes after as before (cmp);
# BEFORE_REF=AFTER_REF compares a merged version with the number that replaced it.
same_refs() {
    local before=$1 after=$2 ref; shift 2
    for ref in "$@"; do
        cmp "$before/${ref%%=*}.raw" "$after/${ref##*=}.raw" || fail "$ref serves other bytes after the merge"
    done
}

# judge_chain NAME — qemu-img check on every qcow2 file the metadata of NAME lists, and
# qemu-img info --backing-chain on every layer names the chain the metadata lists.
judge_chain() {
    local name=$1 dir=$STORE/vdisks/$1
    vds vdisk info "$name" --json >"$E2E_TMP/judge.json"
    python3 - "$E2E_TMP/judge.json" "$dir" <<'PY' || fail "the chain of $name is not what its metadata lists"
import json, os, subprocess, sys
meta = json.load(open(sys.argv[1]))["meta"]
d = sys.argv[2]
assert "pending_merge" not in meta, meta
chain = [meta["base"]["file"]]
for v in meta["versions"]:
    chain.append(v["file"])
for i, f in enumerate(chain):
    p = os.path.join(d, f)
    if f.endswith(".qcow2"):
        subprocess.run(["qemu-img", "check", p], check=True, stdout=subprocess.DEVNULL)
    info = json.loads(subprocess.run(["qemu-img", "info", "--backing-chain", "--output=json", p], check=True, capture_output=True).stdout)
    got = [os.path.basename(x["filename"]) for x in reversed(info)]
    assert got == chain[: i + 1], (f, got, chain[: i + 1])
PY
}

host_secret() {
    marker="HOST-SECRET-$$-$RANDOM$RANDOM"
    secret=$E2E_TMP/secret
    "$PY" -c "import sys; m=sys.argv[1].encode(); open(sys.argv[2],'wb').write((m + bytes(4096 - len(m))) * 256 * int(sys.argv[3]))" \
        "$marker" "$secret" "$1"
    chmod 600 "$secret"
}
