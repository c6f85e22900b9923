#!/usr/bin/env bash
# Many connections at once: 20 nbdinfo in parallel all succeed and report the right
# size; then 8 nbdsh clients in parallel each write and verify their own 1 MiB region,
# and a final client sees all 8 regions.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require nbdinfo nbdsh
require_python_nbd
e2e_init

start_server --memory 64M
pids=()
for i in $(seq 20); do
    timeout 30 nbdinfo --size "$URI" >"$E2E_TMP/info.$i" 2>&1 &
    pids+=($!)
done
failed=0
for i in "${!pids[@]}"; do
    wait "${pids[i]}" || failed=$((failed + 1))
done
((failed == 0)) || fail "$failed of 20 parallel nbdinfo failed: $(cat "$E2E_TMP"/info.* | sort | uniq -c)"
bad=$(grep -Lx $((64 * 1024 * 1024)) "$E2E_TMP"/info.* || true)
[[ -z $bad ]] || fail "wrong size from: $bad"
log "ok: 20 parallel nbdinfo"

pids=()
for i in $(seq 0 7); do
    timeout 60 nbdsh -u "$URI" -c "$NBDSH_PRELUDE
import os
d = bytes([$i + 1]) * (1 << 20)
for k in range(4):
    h.pwrite(d, $i << 20)
    assert h.pread(1 << 20, $i << 20) == d
flush_if_offered()
" >"$E2E_TMP/sh.$i" 2>&1 &
    pids+=($!)
done
failed=0
for i in "${!pids[@]}"; do
    wait "${pids[i]}" || { failed=$((failed + 1)); cat "$E2E_TMP/sh.$i" >&2; }
done
((failed == 0)) || fail "$failed of 8 parallel nbdsh clients failed"
nbdsh_script "
for i in range(8):
    assert h.pread(1 << 20, i << 20) == bytes([i + 1]) * (1 << 20), f'region {i} wrong'
"
log "ok: 8 parallel writers"
