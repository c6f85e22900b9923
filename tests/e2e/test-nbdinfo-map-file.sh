#!/usr/bin/env bash
# nbdinfo --map on a sparse raw file: runs that hold data in the file (as the file
# system sees them with SEEK_DATA/SEEK_HOLE) are data, the rest are holes.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdinfo
require_python_nbd
e2e_init

MiB=$((1024 * 1024))
img=$E2E_TMP/sparse.img
truncate -s 48M "$img"
ranges=("$((2 * MiB)):$((1 * MiB))" "$((16 * MiB)):$((3 * MiB))" "$((40 * MiB)):$((2 * MiB))")
for r in "${ranges[@]}"; do
    dd if=/dev/urandom of="$img" bs=1M seek=$((${r%%:*} / MiB)) count=$((${r##*:} / MiB)) \
        conv=notrunc status=none
done
sync "$img"

# What the file system itself says (so a file system that doesn't do holes is a skip).
fs_ranges=$("$PY" - "$img" <<'PYEOF'
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
end = os.fstat(fd).st_size
off, out = 0, []
while off < end:
    try:
        d = os.lseek(fd, off, os.SEEK_DATA)
    except OSError:
        break
    h = os.lseek(fd, d, os.SEEK_HOLE)
    out.append(f"{d}:{h - d}")
    off = h
print(" ".join(out))
PYEOF
)
log "file system data ranges: $fs_ranges"
[[ $fs_ranges == "${ranges[*]}" ]] || skip "file system does not report holes exactly (got '$fs_ranges')"

start_server --read-only "$img"
nbdinfo --map --json "$URI" >"$E2E_TMP/map.json"
cat "$E2E_TMP/map.json" >&2
"$PY" "$E2E_DIR/map.py" "$E2E_TMP/map.json" $((48 * MiB)) "${ranges[@]}" || fail "map does not match the file"
