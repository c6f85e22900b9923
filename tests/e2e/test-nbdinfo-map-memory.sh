#!/usr/bin/env bash
# nbdinfo --map on a sparse --memory disk: a fresh disk is one hole; after writing 2 MiB
# runs at a few 2 MiB-aligned offsets (and zeroing/trimming nothing else), the map shows
# data exactly where the writes went and holes everywhere else.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdinfo nbdsh
require_python_nbd
e2e_init

MiB=$((1024 * 1024))
size=$((64 * MiB))
start_server --memory 64M

nbdinfo --map --json "$URI" >"$E2E_TMP/empty.json"
cat "$E2E_TMP/empty.json" >&2
"$PY" "$E2E_DIR/map.py" "$E2E_TMP/empty.json" $size || fail "fresh memory disk is not all hole"

ranges=("$((4 * MiB)):$((2 * MiB))" "$((20 * MiB)):$((4 * MiB))" "$((62 * MiB)):$((2 * MiB))")
for r in "${ranges[@]}"; do
    nbdsh_script "h.pwrite(b'\\x5a' * ${r##*:}, ${r%%:*}); flush_if_offered()"
done
nbdinfo --map --json "$URI" >"$E2E_TMP/map.json"
cat "$E2E_TMP/map.json" >&2
"$PY" "$E2E_DIR/map.py" "$E2E_TMP/map.json" $size "${ranges[@]}" || fail "map does not match the writes"
