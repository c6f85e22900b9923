#!/usr/bin/env bash
# The disk cache types on each cache-file engine and with zero-filled preallocation
# (`--io-engine io_uring|sync`, `--zero-fill on`), O_DIRECT, serve a raw base image (random
# data and holes, 64 MiB) to fio's nbd engine: mixed random reads/writes, 4k-64k blocks,
# queue depth 16 on 4 jobs (disjoint 6 MiB ranges), then unaligned 512 B-16 KiB blocks (partial-page
# read-modify-write); crc32c verification of everything written — exit 0, no verify
# errors; the server exits cleanly (the io_uring thread ends) and the base is unchanged.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=fio-verify.sh
source "$E2E_DIR/fio-verify.sh"
require fio cmp nbdsh
require_python_nbd
require_vdstream
e2e_init

MIB=64
base=$E2E_TMP/base.img
make_sparse_image "$base" $MIB
dd if=/dev/urandom of="$base" bs=1M seek=16 count=4 conv=notrunc status=none
pristine=$E2E_TMP/base.pristine
cp --sparse=always "$base" "$pristine"

for setting in "device-disk:io_uring:off" "device-disk:io_uring:on" "device-disk:sync:on" "device-disk-persistent:io_uring:off"; do
    IFS=: read -r type engine zero <<<"$setting"
    name="$type-$engine-zero-$zero"
    log "==== $name ===="
    dir=$E2E_TMP/cache-$name
    mkdir -p "$dir"
    start_server "$base" --cache "$type" --overflow-dir "$dir" --name "t-$name" --io-engine "$engine" --zero-fill "$zero"
    run_fio_verify "$name" --rw=randrw --rwmixwrite=70 --bsrange=4k-64k --size=6m \
        --iodepth=16 --numjobs=4 --offset=1m --offset_increment=6m
    run_fio_verify "$name-unaligned" --rw=randrw --rwmixwrite=70 --bsrange=512-16k \
        --blockalign=512 --size=6m --iodepth=16 --offset=$((16 * 1024 * 1024 - 512))
    server_alive "$SERVER_PID" || fail "$name: server died during fio"
    nbdsh_script 'flush_if_offered()'
    rc=0
    stop_server "$SERVER_PID" 15 || rc=$?
    assert_eq "$name: server exit status" "$rc" 0
    cmp "$base" "$pristine" || fail "$name: the base file was modified"
    log "ok: $name: fio verified, clean exit, base unchanged"
done
