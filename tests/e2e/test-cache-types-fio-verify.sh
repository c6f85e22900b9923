#!/usr/bin/env bash
# Every write-cache type (`serve-image FILE --cache TYPE`) serves a raw base image (random
# data and holes, 64 MiB) to fio's nbd engine: mixed random reads/writes, 4k-64k blocks,
# queue depth 16, then unaligned 512 B-16 KiB blocks over random base data (partial-page
# read-modify-write); crc32c verification of everything written — exit 0, no verify errors.
# Afterwards the base file is byte-for-byte unchanged (cmp with a pristine copy) while the
# export does serve fio's data (qemu-img compare export vs base finds a difference) — for
# every type but `private`, whose writes must land in the file: there the file changed and
# holds exactly what the export served (cmp after a clean stop), and a verify-only fio
# pass over the file (through a fresh server) finds every block fio wrote.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=fio-verify.sh
source "$E2E_DIR/fio-verify.sh"
require fio qemu-img cmp nbdsh
require_python_nbd
require_vdstream
e2e_init

MIB=64
base=$E2E_TMP/base.img
make_sparse_image "$base" $MIB
# More random data than make_sparse_image's few regions: 4 MiB at 16 MiB, 1 MiB at 40 MiB + 3 KiB.
dd if=/dev/urandom of="$base" bs=1M seek=16 count=4 conv=notrunc status=none
dd if=/dev/urandom of="$base" bs=1K seek=$((40 * 1024 + 3)) count=1024 conv=notrunc status=none
pristine=$E2E_TMP/base.pristine
cp --sparse=always "$base" "$pristine"

for type in ram-overflow device-ram device-disk device-disk-persistent server server-persistent private; do
    log "==== cache type $type ===="
    dir=$E2E_TMP/cache-$type
    mkdir -p "$dir"
    img=$base
    if [[ $type == private ]]; then
        img=$E2E_TMP/private.img
        cp --sparse=always "$pristine" "$img"
    fi
    extra=()
    case $type in
    ram-overflow) extra=(--ram 8M) ;;    # small, so that the overflow file is used too
    device-ram) extra=(--ram 128M) ;;
    esac
    start_server "$img" --cache "$type" --overflow-dir "$dir" --name "t-$type" "${extra[@]}"
    run_fio_verify "$type" --rw=randrw --rwmixwrite=70 --bsrange=4k-64k --size=24m \
        --iodepth=16 --offset=1m
    # Unaligned 512 B-16 KiB writes over the random part of the base: partial pages are
    # read from the base and merged (read-modify-write) before they enter the cache.
    run_fio_verify "$type-unaligned" --rw=randrw --rwmixwrite=70 --bsrange=512-16k \
        --blockalign=512 --size=6m --iodepth=16 --offset=$((40 * 1024 * 1024 - 512))
    server_alive "$SERVER_PID" || fail "$type: server died during fio"
    nbdsh_script 'flush_if_offered()'
    if [[ $type == private ]]; then
        # What the export serves now (fio's verified data over the base) ...
        run_bounded 120 qemu-img convert -f raw -O raw "$URI" "$E2E_TMP/private.served" ||
            fail "$type: cannot read the export back"
        rc=0
        stop_server "$SERVER_PID" 15 || rc=$?
        assert_eq "$type: server exit status" "$rc" 0
        # ... is what the file holds once the server is gone; and that is not the base.
        ! cmp -s "$img" "$pristine" || fail "$type: the file did not receive the writes"
        assert_eq "$type: file size" "$(stat -c %s "$img")" $((MIB << 20))
        cmp "$img" "$E2E_TMP/private.served" || fail "$type: the file differs from what the export served"
        log "ok: $type: the file changed and holds what the export served"
        # Re-verify fio's data straight from the file (verify-only pass, no writes).
        start_server "$img" --cache device-ram --ram 64M --overflow-dir "$dir"
        log "verify-only pass over the file written in private mode"
        run_bounded 300 fio --name=private-reverify --ioengine=nbd --uri="$URI" \
            --rw=randrw --rwmixwrite=70 --bsrange=4k-64k --size=24m --iodepth=16 --offset=1m \
            --verify=crc32c --verify_fatal=1 --verify_only=1 --verify_state_save=0 \
            >"$E2E_TMP/fio-private-reverify.out" 2>&1 ||
            { cat "$E2E_TMP/fio-private-reverify.out" >&2; fail "$type: fio's data is not in the file"; }
        stop_server "$SERVER_PID" 15 || true
    else
        rc=0
        run_bounded 120 qemu-img compare -q -f raw -F raw "$base" "$URI" || rc=$?
        assert_eq "$type: qemu-img compare base vs export (1 = differ)" "$rc" 1
        rc=0
        stop_server "$SERVER_PID" 15 || rc=$?
        assert_eq "$type: server exit status" "$rc" 0
        cmp "$base" "$pristine" || fail "$type: the base file was modified"
        log "ok: $type: base file unchanged"
    fi
done
