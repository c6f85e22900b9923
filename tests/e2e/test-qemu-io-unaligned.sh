#!/usr/bin/env bash
# qemu-io with byte-granular offsets and lengths (not multiples of 512 or 4096): writes
# that straddle block boundaries read back, don't disturb neighbouring bytes, and an
# unaligned write -z zeroes exactly its range. Also run against a file-backed export.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require qemu-io
e2e_init

truncate -s 16M "$E2E_TMP/disk.img"
for args in "--memory 16M" "$E2E_TMP/disk.img"; do
    # shellcheck disable=SC2086
    start_server $args
    out=$E2E_TMP/qemu-io.out
    rc=0
    # --image-opts with a request alignment of 1 byte makes qemu send the odd requests as-is.
    run_bounded 120 qemu-io --image-opts "driver=raw,file.driver=nbd,file.path=$SOCK,file.export=" \
        -c 'write -P 0x11 0 64k' \
        -c 'write -P 0x22 4095 2' -c 'read -P 0x11 4094 1' -c 'read -P 0x22 4095 2' -c 'read -P 0x11 4097 1' \
        -c 'write -P 0x33 1000 7001' -c 'read -P 0x11 999 1' -c 'read -P 0x33 1000 7001' -c 'read -P 0x11 8001 1' \
        -c 'write -z 12345 777' -c 'read -P 0x11 12344 1' -c 'read -P 0 12345 777' -c 'read -P 0x11 13122 1' \
        -c 'write -P 0x44 1048573 5' -c 'read -P 0x44 1048573 5' \
        -c 'aio_write -P 0x55 2000001 333' -c 'aio_write -P 0x66 3000003 4444' -c 'aio_flush' \
        -c 'read -P 0x55 2000001 333' -c 'read -P 0x66 3000003 4444' -c 'read -P 0 3004447 1' \
        >"$out" 2>&1 || rc=$?
    cat "$out" >&2
    [[ $rc -eq 0 ]] || fail "qemu-io exited $rc ($args)"
    if grep -Eiq 'verification failed|error|failed' "$out"; then
        fail "qemu-io reported a failure ($args)"
    fi
    n=$(grep -c '^read ' "$out" || true)
    ((n == 13)) || fail "expected 13 completed reads, saw $n ($args)"
done
