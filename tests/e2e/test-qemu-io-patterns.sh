#!/usr/bin/env bash
# qemu-io against a --memory export: aligned pattern writes read back, write -z zeroes,
# discard, and 16 overlapping-free aio_write's followed by aio_read verification. Every
# `read -P` verifies; any "Pattern verification failed" or error output is a failure.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require qemu-io
e2e_init

start_server --memory 64M
cmds=(
    -c 'write -P 0xab 0 1M' -c 'read -P 0xab 0 1M'
    -c 'write -z 1M 1M' -c 'read -P 0 1M 1M'
    -c 'write -P 0xcd 2M 2M' -c 'discard 2M 1M' -c 'read -P 0xcd 3M 1M'
    -c 'write -P 0x11 8M 4M' -c 'write -z -u 8M 2M' -c 'read -P 0 8M 2M' -c 'read -P 0x11 10M 2M'
    -c 'write -f -P 0x22 16M 64k' -c 'read -P 0x22 16M 64k'
    -c 'flush'
)
for i in $(seq 0 15); do
    cmds+=(-c "aio_write -P $((0x30 + i)) $((32 + i))M 256k")
done
cmds+=(-c 'aio_flush')
for i in $(seq 0 15); do
    cmds+=(-c "aio_read -P $((0x30 + i)) $((32 + i))M 256k")
done
cmds+=(-c 'aio_flush')

out=$E2E_TMP/qemu-io.out
rc=0
run_bounded 120 qemu-io -f raw "$URI" "${cmds[@]}" >"$out" 2>&1 || rc=$?
cat "$out" >&2
[[ $rc -eq 0 ]] || fail "qemu-io exited $rc"
if grep -Eiq 'verification failed|error|failed' "$out"; then
    fail "qemu-io reported a failure"
fi
n=$(grep -c '^read ' "$out" || true)
((n == 22)) || fail "expected 22 completed reads in qemu-io output, saw $n"
