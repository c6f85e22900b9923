#!/usr/bin/env bash
# Bad input to `vdstream target attach` and `target status`, each a clear message and a
# non-zero exit within its bound:
#   no server reachable (--retry-for 2s)      names the server and --retry-for
#   unknown vDisk (export the server lacks)   fails at once: the server refused the export
#   an http:// server nobody answers on       waits; with --retry-for names it: no store server answered
#   NBD URIs and http:// URLs mixed           says to give every --server the same kind
#   unknown cache type                        lists the valid types
#   bad target id                             says which characters are allowed
#   a socket path a live server answers on    refused; the other server keeps running
#   the same target id attached twice         names the running agent's pid
#   status of an unknown target               "is it attached?"
#   the server comes back with another size   guest reads fail with EIO after --retry-for,
#                                             the log says the size changed
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
require nbdinfo qemu-io
require_python_nbd
require_vdstream
e2e_init
agent_env
mkdir -p "$VDSTREAM_RUN_DIR"

# expect_fail SECS PATTERN CMD... — CMD exits non-zero within SECS and prints PATTERN.
expect_fail() {
    local secs=$1 pattern=$2; shift 2
    local out=$E2E_TMP/out.txt rc=0 t0=$SECONDS
    timeout --kill-after=5 "$secs" "$@" >"$out" 2>&1 || rc=$?
    cat "$out" >&2
    [[ $rc -ne 0 ]] || fail "should have failed: $*"
    [[ $rc -ne 124 && $rc -ne 137 ]] || fail "did not finish within ${secs}s: $*"
    grep -Eq "$pattern" "$out" || fail "message lacks /$pattern/: $*"
    log "ok: refused in $((SECONDS - t0))s: ${*:2:3}"
}
V=$VDSTREAM_BIN

expect_fail 15 "no server answered for .*retry-for.*nobody.sock" \
    "$V" target attach t1 --server "nbd+unix:///?socket=$E2E_TMP/nobody.sock" --retry-for 2s

base=$E2E_TMP/base.img
head -c $((16 << 20)) /dev/urandom >"$base"
start_server "$base" --read-only --name golden
srv_sock=$SOCK srv_pid=$SERVER_PID
expect_fail 15 "refused the export.*nosuch" \
    "$V" target attach t1 --server "nbd+unix:///vdisk/nosuch@3?socket=$srv_sock"
# No store server answering waits (forever by default, a booting target's server may be
# down; test-agent-boot-wait.sh); --retry-for bounds it.
expect_fail 15 "no store server answered for target t1.*127.0.0.1:1" "$V" target attach t1 --server http://127.0.0.1:1 --retry-for 2s
expect_fail 5 "every --server" "$V" target attach t1 --server "nbd+unix:///?socket=$srv_sock" --server http://127.0.0.1:1
expect_fail 5 "ram-overflow" "$V" target attach t1 --server "nbd+unix:///?socket=$srv_sock" --cache ramdisk
expect_fail 5 "letters, digits" "$V" target attach 'a/b' --server "nbd+unix:///?socket=$srv_sock"
expect_fail 15 "live server.*listening" \
    "$V" target attach t1 --server "nbd+unix:///?socket=$srv_sock" --socket "$srv_sock"
server_alive "$srv_pid" || fail "the server died when an agent tried its socket"
expect_fail 5 "is it attached" "$V" target status nobody

start_agent t1 --server "nbd+unix:///?socket=$srv_sock" --retry-for 2s
expect_fail 15 "already attached.*pid $AGENT_PID" \
    "$V" target attach t1 --server "nbd+unix:///?socket=$srv_sock" --socket "$E2E_TMP/other.sock"

# The server comes back with another size: the agent refuses it, guest reads of data it
# has not cached fail with EIO once --retry-for is over, and the agent says why.
stop_server "$srv_pid" 10 || true
truncate -s 8M "$E2E_TMP/small.img"
start_server_on "$srv_sock" "$E2E_TMP/small.img" --read-only
rc=0
timeout 20 nbdsh -u "$URI" -c 'h.pread(4096, 12 << 20)' >"$E2E_TMP/read.txt" 2>&1 || rc=$?
cat "$E2E_TMP/read.txt" >&2
[[ $rc -ne 0 && $rc -ne 124 ]] || fail "a read through the agent should fail (exit $rc)"
grep -q "EIO\|Input/output error" "$E2E_TMP/read.txt" || fail "the guest did not get EIO"
grep -q "8388608 bytes but was 16777216 bytes at attach" "$AGENT_LOG" || fail "the agent log does not say the size changed"
log "ok: a server with another size is refused; the guest gets EIO after --retry-for"
server_alive "$AGENT_PID" || fail "the agent died"
