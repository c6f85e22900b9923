#!/usr/bin/env bash
# The server-side write cache of a `server` target on a file system that fills (issue 17,
# item 8, server side): STORE/cache is a 6 MiB tmpfs, the vDisk 32 MiB. A client writes
# until the cache's file system refuses 5 writes with ENOSPC; then, while it is connected,
# GET /api/v1/sessions shows the same figures as an agent's status: nospace_errors 5,
# limit_bytes the vDisk's size, fs_free_bytes and capacity_bytes from the file system
# (capacity = min(limit, used + free)), and used_percent measured against that capacity
# (nearly 100%, not a fifth of the vDisk); /metrics has the same as
# vdstream_session_cache_{nospace_errors_total,capacity_bytes,fs_free_bytes,used_percent}.
# Needs root (it mounts a small tmpfs).
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=server-lib.sh
source "$E2E_DIR/server-lib.sh"
require nbdsh nbdinfo mount umount
require_python_nbd
require_vdstream
[[ $(id -u) == 0 ]] || skip "mounting a small tmpfs needs root"
e2e_init
store_init

vds vdisk create w --size 32M >/dev/null
vds target add s1 --vdisk w --cache server >/dev/null
mkdir -p "$STORE/cache"
mount -t tmpfs -o size=6m,mode=0700 tmpfs "$STORE/cache" || fail "cannot mount a 6 MiB tmpfs on $STORE/cache"
cleanup_mount() {
    local pid
    for pid in "${E2E_PIDS[@]}"; do stop_pid "$pid" 5; done
    umount "$STORE/cache" 2>/dev/null || umount -l "$STORE/cache"
}
trap 'rc=$?; cleanup_mount; (exit $rc); e2e_cleanup' EXIT

start_store_server --http 127.0.0.1:0
API=$(grep -Eo 'http://127\.0\.0\.1:[0-9]+' "$SERVER_LOG" | tail -n1)
[[ -n $API ]] || fail "the server did not print its HTTP address: $(cat "$SERVER_LOG")"

URI=$(xuri target/s1)
API=$API nbdsh_script "
import json, os, re, urllib.request
import nbd
write_until_enospc(5)
api = os.environ['API']
sessions = json.load(urllib.request.urlopen(api + '/api/v1/sessions', timeout=10))
s = [s for s in sessions if s.get('target') == 's1']
assert len(s) == 1, sessions
c = s[0]['cache']
print('cache of s1 in /api/v1/sessions:', c)
assert c['type'] == 'server', c
assert c['nospace_errors'] == 5, ('writes refused for space (file system full)', c)
assert c['limit_bytes'] == 32 << 20, ('limit_bytes: the vDisk size', c)
assert c['fs_free_bytes'] is not None and c['fs_free_bytes'] < (1 << 20), ('fs_free_bytes', c)
assert c['capacity_bytes'] <= 6 << 20 and c['capacity_bytes'] >= c['used_bytes'], ('capacity_bytes', c)
assert c['used_percent'] >= 90, ('used_percent: a cache that filled its file system is (nearly) 100% used, not measured against the vDisk', c)
m = urllib.request.urlopen(api + '/metrics', timeout=10).read().decode()
def metric(name):
    found = [l for l in m.splitlines() if l.startswith(name + '{') and 'target=\"s1\"' in l]
    assert len(found) == 1, (name, found)
    return float(found[0].rsplit(' ', 1)[1])
assert metric('vdstream_session_cache_nospace_errors_total') == 5, m
assert metric('vdstream_session_cache_capacity_bytes') == c['capacity_bytes'] or abs(metric('vdstream_session_cache_capacity_bytes') - c['capacity_bytes']) < (1 << 20)
assert metric('vdstream_session_cache_fs_free_bytes') < (1 << 20)
assert metric('vdstream_session_cache_used_percent') >= 90
assert metric('vdstream_session_cache_limit_bytes') == 32 << 20
print('metrics ok')
" || fail "the server-side cache's figures are wrong (see above)"
log "ok: a server cache on a full file system: 5 writes refused for space, used_percent against its real capacity, in the API and /metrics"
log "PASS"
