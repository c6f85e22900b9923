#!/usr/bin/env bash
# Cache folders and their space (issue 17, item 8), for serve-image and target attach:
#   --overflow-dir DIR whose parent is missing   refused (non-zero exit), names DIR and
#                                                 the fix; nothing is created
#   --overflow-dir DIR whose parent exists        DIR is created (mode 0700) and used
#   a cache folder with < 64 MiB free             refused, naming --allow-low-space;
#                                                 with it: starts and warns with the limit
#   an agent whose cache file system fills        the status JSON counts the file system's
#                                                 ENOSPC as refused for space and measures
#                                                 used_percent against what the cache can
#                                                 hold (not the vDisk), with limit and free
#                                                 bytes shown
# Needs root (it mounts a 4 MiB tmpfs).
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
require nbdsh mount umount
require_python_nbd
require_vdstream
[[ $(id -u) == 0 ]] || skip "mounting a small tmpfs needs root"
e2e_init
agent_env
V=$VDSTREAM_BIN

small=$E2E_TMP/small
mkdir "$small"
mount -t tmpfs -o size=4m,mode=0700 tmpfs "$small" || fail "cannot mount a 4 MiB tmpfs on $small"
cleanup_mount() {
    local pid
    for pid in "${E2E_PIDS[@]}"; do stop_pid "$pid" 5; done
    umount "$small" 2>/dev/null || umount -l "$small"
}
trap 'rc=$?; cleanup_mount; (exit $rc); e2e_cleanup' EXIT

# expect_fail SECS PATTERN CMD... — CMD exits non-zero within SECS and prints PATTERN.
expect_fail() {
    local secs=$1 pattern=$2; shift 2
    local out=$E2E_TMP/out.txt rc=0
    timeout --kill-after=5 "$secs" "$@" >"$out" 2>&1 || rc=$?
    cat "$out" >&2
    [[ $rc -ne 0 ]] || fail "should have failed: $*"
    [[ $rc -ne 124 && $rc -ne 137 ]] || fail "did not finish within ${secs}s: $*"
    grep -Eq "$pattern" "$out" || fail "message lacks /$pattern/: $*"
}

base=$E2E_TMP/base.img
head -c $((32 << 20)) /dev/urandom >"$base"

# A mistyped folder: refused, nothing created.
typo=$E2E_TMP/nonexistent/dir
expect_fail 15 "cache folder $typo does not exist.*mkdir -p $E2E_TMP/nonexistent" \
    "$V" serve-image "$base" --socket "$E2E_TMP/s1.sock" --cache ram-overflow --overflow-dir "$typo"
[[ ! -e $E2E_TMP/nonexistent ]] || fail "serve-image created $E2E_TMP/nonexistent"
if [[ ! -e /nonexistent ]]; then
    expect_fail 15 "cache folder /nonexistent/dir does not exist" \
        "$V" serve-image "$base" --socket "$E2E_TMP/s1.sock" --cache device-disk --overflow-dir /nonexistent/dir
    [[ ! -e /nonexistent ]] || fail "serve-image created /nonexistent"
fi
log "ok: serve-image refuses a cache folder whose parent is missing"

# Its parent exists: created, private, used.
start_server "$base" --cache ram-overflow --ram 1M --overflow-dir "$E2E_TMP/newdir"
assert_eq "mode of the created cache folder" "$(stat -c %a "$E2E_TMP/newdir")" 700
stop_server "$SERVER_PID" 15 || fail "serve-image did not stop cleanly"

start_server "$base" --read-only --name golden
srv="nbd+unix:///?socket=$SOCK"
expect_fail 20 "cannot attach target t1: the cache folder $typo does not exist" \
    "$V" target attach t1 --server "$srv" --cache device-disk --overflow-dir "$typo"
[[ ! -e $E2E_TMP/nonexistent ]] || fail "target attach created $E2E_TMP/nonexistent"
log "ok: target attach refuses a cache folder whose parent is missing"

# Too little space: refused unless overridden; then a warning with the limit.
expect_fail 20 "has [0-9]+ bytes free, less than the 67108864 bytes.*--allow-low-space" \
    "$V" serve-image "$base" --socket "$E2E_TMP/s2.sock" --cache device-disk --overflow-dir "$small/srv" --intermediate-buffering on
expect_fail 20 "has [0-9]+ bytes free, less than the 67108864 bytes.*--allow-low-space" \
    "$V" target attach t1 --server "$srv" --cache device-disk --overflow-dir "$small/agent" --intermediate-buffering on
log "ok: a cache folder with less than 64 MiB free is refused"

start_agent t1 --server "$srv" --cache device-disk --overflow-dir "$small/agent" --intermediate-buffering on --allow-low-space
grep -q "less than the 33554432 bytes the cache may use" "$AGENT_LOG" || fail "no warning that the cache may outgrow its folder"
nbdsh_script "
write_until_enospc(5)
"
sleep 1.5   # the status file is rewritten every second
"$V" target status t1 --json >"$E2E_TMP/status.json" || fail "target status t1 failed"
assert_eq "writes refused for space (file system full)" "$(json_get "$E2E_TMP/status.json" 'j["cache"]["nospace_errors"]')" 5
assert_eq "limit_bytes" "$(json_get "$E2E_TMP/status.json" 'j["cache"]["limit_bytes"]')" $((32 << 20))
json_get "$E2E_TMP/status.json" 'j["cache"]["fs_free_bytes"] < (1 << 20) and j["cache"]["capacity_bytes"] <= (4 << 20)' | grep -qx True ||
    fail "status lacks the free space or the capacity: $(json_get "$E2E_TMP/status.json" 'j["cache"]')"
used=$(json_get "$E2E_TMP/status.json" 'j["cache"]["used_percent"]')
json_get "$E2E_TMP/status.json" 'j["cache"]["used_percent"] >= 90' | grep -qx True ||
    fail "used_percent $used: a cache that filled its file system must be (nearly) 100% used, not measured against the vDisk"
"$V" target status t1 | grep -Eq "% used of .*free on its file system" || fail "target status does not show capacity and free space"
log "ok: status counts the file system's ENOSPC and shows used_percent $used against the real capacity"
