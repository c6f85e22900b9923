#!/usr/bin/env bash
# nbdinfo --json on writable exports, a --memory disk and a raw file: the capability flags
# a client relies on (trim, zero, flush, multi-conn on both; FUA too on the file), not
# read-only, structured replies, the base:allocation context, and the advertised block
# sizes (preferred 4096, maximum 32 MiB). Every mismatch is listed before failing.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdinfo
require_python_nbd
e2e_init

check_flags() { # check_flags WHAT SIZE FLAG...
    local what=$1 size=$2; shift 2
    nbdinfo --json "$URI" >"$E2E_TMP/info.json"
    cat "$E2E_TMP/info.json" >&2
    "$PY" - "$E2E_TMP/info.json" "$what" "$size" "$BLOCK_PREFERRED" "$BLOCK_MAXIMUM" "$@" <<'PYEOF'
import json, sys
j = json.load(open(sys.argv[1]))
what, size, pref, maxb, flags = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6:]
e = j["exports"][0]
want = {"structured": (j.get("structured"), True),
        "is_read_only": (e.get("is_read_only"), False),
        "base:allocation in contexts": ("base:allocation" in e.get("contexts", []), True),
        "block_size_preferred": (e.get("block_size_preferred"), pref),
        "block_size_maximum": (e.get("block_size_maximum"), maxb),
        "export-size": (e.get("export-size"), size)}
for f in flags:
    want[f] = (e.get(f), True)
bad = [f"{k}: got {got}, want {w}" for k, (got, w) in want.items() if got != w]
for k in sorted(want):
    print(f"{what}: {k} = {want[k][0]}{'  <-- WRONG' if want[k][0] != want[k][1] else ''}")
if bad:
    sys.exit(f"{what}: " + "; ".join(bad))
PYEOF
}

fails=()
start_server --memory 256M
check_flags "--memory export" $((256 * 1024 * 1024)) can_trim can_zero can_flush can_multi_conn ||
    fails+=("--memory export")

truncate -s 64M "$E2E_TMP/disk.img"
start_server "$E2E_TMP/disk.img"
check_flags "file export" $((64 * 1024 * 1024)) can_trim can_zero can_flush can_fua can_multi_conn ||
    fails+=("file export")

((${#fails[@]} == 0)) || fail "wrong flags on: ${fails[*]}"
