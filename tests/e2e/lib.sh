# shellcheck shell=bash
# tests/e2e/lib.sh — shared helpers for the end-to-end tests (source it, don't run it).
#
# Each test-<feature>-<aspect>.sh sources this file, calls `e2e_init`, starts a server
# with `start_server ARGS...` (the arguments of `vdstream serve-image`), drives it with a
# real client (nbdinfo, nbdsh, qemu-img, qemu-io, fio) and exits
#   0 = pass, 1 = fail, 77 = skip (a client tool is missing).
# Everything the test starts is stopped by the EXIT trap, even on failure, and the
# scratch directory is removed.
#
# Environment:
#   VDSTREAM_E2E_SERVER   vdstream (default) | nbdkit — nbdkit is the stand-in used to
#                         develop the tests themselves; it is told the same block sizes.
#   VDSTREAM_BIN          path of the vdstream binary (default: <repo>/target/release/vdstream)
#   VDSTREAM_E2E_READY_SECS  how long to wait for a server to accept (default 20)
#   VDSTREAM_E2E_KEEP     1 = keep the scratch directory for debugging
#   VDSTREAM_E2E_TLS      1 = servers started by start_server run with --tls require and
#                         certificates made with openssl in the scratch dir (PKI_DIR);
#                         agents started by start_agent connect with the client's
#                         (tls-lib.sh; test-tls-agent-kill.sh runs the kill tests so)

set -euo pipefail
# A command that stops the test through `set -e` says which one and where, in the log
# (not where `set +e` lets a status be looked at, as the cleanup's `wait` does).
set -E
trap '__e2e_status=$?; [[ $- != *e* ]] || printf "%s: \`%s\` failed (exit %s) at %s:%s\n" "$E2E_NAME" "$BASH_COMMAND" "$__e2e_status" "${BASH_SOURCE[0]}" "$LINENO" >&2' ERR

E2E_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
REPO_ROOT=$(cd "$E2E_DIR/../.." && pwd)
E2E_NAME=$(basename "$0" .sh)

VDSTREAM_E2E_SERVER=${VDSTREAM_E2E_SERVER:-vdstream}
VDSTREAM_BIN=${VDSTREAM_BIN:-$REPO_ROOT/target/release/vdstream}
READY_SECS=${VDSTREAM_E2E_READY_SECS:-20}

# Debian's libnbd python bindings are only visible to the system interpreter.
PY=/usr/bin/python3
export PATH=/usr/bin:/usr/sbin:/bin:/sbin:$PATH

# What the server advertises (vdstream's contract; nbdkit is configured to match).
BLOCK_PREFERRED=4096
BLOCK_MAXIMUM=33554432

E2E_TMP=
E2E_PIDS=()          # background processes to stop on exit (servers, clients)
E2E_SERVER_PIDS=()   # subset: servers (their logs are shown on failure)
E2E_SERVER_LOGS=()
E2E_CLEANUP_HOOKS=() # commands run on exit after the processes stopped, before the scratch
                     # directory goes (network namespaces, logs kept on failure); $1 = exit status

# Servers started by start_server set these:
SERVER_PID=
SOCK=
URI=
SERVER_LOG=

log()  { printf '%s: %s\n' "$E2E_NAME" "$*" >&2; }
# The message is kept and said again after the server logs that the cleanup prints, so a
# CI that keeps only the end of the output still shows why the test failed.
E2E_FAILURE=
fail() {
    E2E_FAILURE="$*"
    printf '%s: FAIL: %s\n' "$E2E_NAME" "$*" >&2
    exit 1
}
skip() { printf '%s: SKIP: %s\n' "$E2E_NAME" "$*" >&2; exit 77; }

# require CMD... — skip the test unless every command is on PATH.
require() {
    local c
    for c in "$@"; do
        command -v "$c" >/dev/null 2>&1 || skip "$c is not installed"
    done
}

require_python_nbd() {
    [[ -x $PY ]] || skip "$PY not found"
    "$PY" -c 'import nbd' 2>/dev/null || skip "python3-libnbd is not installed (import nbd failed under $PY)"
}

# require_vdstream — for tests of the vdstream CLI itself (not meaningful against nbdkit).
require_vdstream() {
    [[ $VDSTREAM_E2E_SERVER == vdstream ]] || skip "tests the vdstream CLI; server is $VDSTREAM_E2E_SERVER"
    [[ -x $VDSTREAM_BIN ]] || fail "$VDSTREAM_BIN not found: run 'cargo build --release' first"
}

is_vdstream() { [[ $VDSTREAM_E2E_SERVER == vdstream ]]; }

e2e_init() {
    E2E_TMP=$(mktemp -d "${TMPDIR:-/tmp}/vdstream-e2e.$E2E_NAME.XXXXXX")
    trap e2e_cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
    if [[ ${VDSTREAM_E2E_TLS:-0} == 1 ]]; then
        # shellcheck source=tls-lib.sh
        source "$E2E_DIR/tls-lib.sh"
        PKI_DIR=$E2E_TMP/pki
        make_pki "$PKI_DIR"
        log "TLS on: servers run with --tls require, certificates in $PKI_DIR"
    fi
}

# stop_pid PID SECS — SIGTERM, wait up to SECS, then SIGKILL. Never blocks longer.
stop_pid() {
    local pid=$1 secs=${2:-10} i
    kill -0 "$pid" 2>/dev/null || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < secs * 10; i++)); do
        kill -0 "$pid" 2>/dev/null || return 0
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
}

e2e_cleanup() {
    local rc=$? pid i
    trap - EXIT
    set +e
    # Clients first (started last), then servers.
    for ((i = ${#E2E_PIDS[@]} - 1; i >= 0; i--)); do
        stop_pid "${E2E_PIDS[i]}" 5
    done
    for pid in "${E2E_PIDS[@]}"; do
        wait "$pid" 2>/dev/null
    done
    for ((i = 0; i < ${#E2E_CLEANUP_HOOKS[@]}; i++)); do
        ${E2E_CLEANUP_HOOKS[i]} "$rc"
    done
    if [[ $rc -ne 0 && $rc -ne 77 ]]; then
        for ((i = 0; i < ${#E2E_SERVER_LOGS[@]}; i++)); do
            if [[ -s ${E2E_SERVER_LOGS[i]} ]]; then
                echo "---- server log ${E2E_SERVER_LOGS[i]##*/} (last 40 lines) ----" >&2
                tail -n 40 "${E2E_SERVER_LOGS[i]}" >&2
                echo "----" >&2
            fi
        done
        [[ -n $E2E_FAILURE ]] && printf '%s: FAIL: %s\n' "$E2E_NAME" "$E2E_FAILURE" >&2
    fi
    if [[ -n $E2E_TMP && ${VDSTREAM_E2E_KEEP:-0} != 1 ]]; then
        rm -rf "$E2E_TMP"
    elif [[ -n $E2E_TMP ]]; then
        log "kept scratch directory $E2E_TMP"
    fi
    exit "$rc"
}

# track_pid PID — stop this background process on exit.
track_pid() { E2E_PIDS+=("$1"); }

# server_command SOCKET ARGS... — print (NUL-separated) the command line that serves
# ARGS (vdstream serve-image syntax) on SOCKET, for the configured server kind.
server_command() {
    local sock=$1; shift
    case $VDSTREAM_E2E_SERVER in
    vdstream)
        [[ -x $VDSTREAM_BIN ]] || fail "$VDSTREAM_BIN not found: run 'cargo build --release' first"
        printf '%s\0' "$VDSTREAM_BIN" serve-image --socket "$sock" "$@"
        if [[ ${VDSTREAM_E2E_TLS:-0} == 1 ]]; then
            printf '%s\0' --tls require --tls-certificates "$PKI_DIR/server"
        fi
        ;;
    nbdkit)
        local ro=() name=() plugin=() direct=0
        while (($#)); do
            case $1 in
            --read-only) ro=(-r) ;;
            --direct) direct=1 ;;
            --name) name=("exportname=$2"); shift ;;
            --memory) plugin=(memory "size=$2"); shift ;;
            -*) fail "nbdkit stand-in: unsupported option $1" ;;
            *) plugin=(file "file=$1") ;;
            esac
            shift
        done
        ((${#plugin[@]})) || fail "start_server: give FILE or --memory SIZE"
        if ((direct)); then plugin+=(cache=none); fi
        # exportname filter: answer to "" and --name only, like vdstream.
        printf '%s\0' nbdkit -f -U "$sock" "${ro[@]}" \
            --filter=exportname --filter=blocksize-policy "${plugin[@]}" \
            exportname= "${name[@]}" exportname-list=explicit exportname-strict=true \
            blocksize-minimum=1 blocksize-preferred=$BLOCK_PREFERRED \
            blocksize-maximum=$BLOCK_MAXIMUM blocksize-error-policy=error
        ;;
    *) fail "VDSTREAM_E2E_SERVER must be vdstream or nbdkit, not '$VDSTREAM_E2E_SERVER'" ;;
    esac
}

# start_server ARGS... — start a server (args as for `vdstream serve-image`, without
# --socket) on a fresh unix socket and wait until it completes an NBD handshake.
# Sets SERVER_PID, SOCK, URI, SERVER_LOG.
start_server() {
    SOCK=$E2E_TMP/server${#E2E_SERVER_PIDS[@]}.sock
    URI="nbd+unix:///?socket=$SOCK"
    start_server_on "$SOCK" "$@"
}

# start_server_on SOCK ARGS... — the same on a given socket path (to restart a server where
# it was), leaving SOCK and URI as they are. Sets SERVER_PID, SERVER_LOG.
start_server_on() {
    local sock=$1 n=${#E2E_SERVER_PIDS[@]} cmd=()
    shift
    SERVER_LOG=$E2E_TMP/server$n.log
    mapfile -d '' cmd < <(server_command "$sock" "$@")
    ((${#cmd[@]})) || exit 1
    log "starting: ${cmd[*]}"
    "${cmd[@]}" >"$SERVER_LOG" 2>&1 </dev/null &
    SERVER_PID=$!
    E2E_PIDS+=("$SERVER_PID")
    E2E_SERVER_PIDS+=("$SERVER_PID")
    E2E_SERVER_LOGS+=("$SERVER_LOG")
    if [[ ${VDSTREAM_E2E_TLS:-0} == 1 ]]; then
        wait_ready "$SERVER_PID" "nbds+unix:///?socket=$sock&tls-certificates=$PKI_DIR/client"
    else
        wait_ready "$SERVER_PID" "nbd+unix:///?socket=$sock"
    fi
}

# wait_ready PID URI — poll (bounded) until URI answers a full handshake.
wait_ready() {
    local pid=$1 uri=$2 deadline=$((SECONDS + READY_SECS)) rc sock
    sock=${uri##*socket=}
    sock=${sock%%&*}
    while ((SECONDS < deadline)); do
        if ! kill -0 "$pid" 2>/dev/null; then
            wait "$pid" 2>/dev/null && rc=0 || rc=$?
            fail "server exited (status $rc) before accepting connections"
        fi
        if [[ -S $sock ]] && timeout 5 nbdinfo --size "$uri" >/dev/null 2>&1; then
            return 0
        fi
        sleep 0.1
    done
    fail "server did not accept an NBD handshake on $uri within ${READY_SECS}s"
}

# stop_server [PID] [SECS] — SIGTERM (or $SIGNAL) and wait up to SECS for exit.
# Prints nothing; returns the server's exit status, or 124 if it had to be killed.
stop_server() {
    local pid=${1:-$SERVER_PID} secs=${2:-10} sig=${SIGNAL:-TERM} i rc
    kill -"$sig" "$pid" 2>/dev/null || return 0
    for ((i = 0; i < secs * 10; i++)); do
        if ! kill -0 "$pid" 2>/dev/null; then
            wait "$pid" 2>/dev/null && rc=0 || rc=$?
            return "$rc"
        fi
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
    return 124
}

server_alive() { kill -0 "${1:-$SERVER_PID}" 2>/dev/null; }

# Python run before every nbdsh script: flush only where the export offers it, so
# tests whose subject is not flush don't fail on a memory disk without flush (that
# capability is asserted by test-nbdinfo-flags and test-nbdsh-flush-fua-cache).
NBDSH_PRELUDE='
def flush_if_offered(handle=None):
    handle = handle or h
    if handle.can_flush():
        handle.flush()

def write_until_enospc(refusals, first_page=0, limit=32 << 20):
    """Writes 4 KiB pages (page p holds byte p % 251 + 1) from first_page on until
    `refusals` of them were refused with ENOSPC (a full cache or file system) or `limit`
    bytes were tried; returns the pages that were written. Any other error, or space that
    never runs out, fails the script."""
    import errno, nbd
    P = 4096
    written, refused, p = [], 0, first_page
    while refused < refusals and p < limit // P:
        try:
            h.pwrite(bytes([p % 251 + 1]) * P, p * P)
            written.append(p)
        except nbd.Error as e:
            assert e.errno == errno.ENOSPC or "ENOSPC" in str(e) or "No space" in str(e), f"page {p}: {e} (want ENOSPC)"
            refused += 1
        p += 1
    assert refused == refusals, f"the file system never filled: {refused} of {refusals} writes refused"
    return written
'

# nbdsh_script SCRIPT [nbdsh options...] — run python SCRIPT with `h` connected to $URI
# (base:allocation requested). A python exception fails the script (non-zero exit).
nbdsh_script() {
    local script=$1; shift
    timeout 120 nbdsh --base-allocation "$@" -u "$URI" -c "$NBDSH_PRELUDE$script"
}

# json_get FILE EXPR — evaluate python EXPR over the JSON document `j` loaded from FILE.
json_get() {
    "$PY" -c 'import json,sys; j=json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$1" "$2"
}

# assert_eq WHAT GOT WANT
assert_eq() {
    [[ $2 == "$3" ]] || fail "$1: got '$2', want '$3'"
    log "ok: $1 = $3"
}

# make_sparse_image FILE SIZE_MIB — a sparse raw image with random data at a few
# offsets (some unaligned) and holes elsewhere. Prints nothing.
make_sparse_image() {
    local file=$1 mib=$2
    truncate -s "${mib}M" "$file"
    # offset (in KiB) : length (in KiB)
    local spec
    for spec in 0:64 1024:1024 3000:5 4100:513 $((mib * 1024 - 8)):8; do
        dd if=/dev/urandom of="$file" bs=1K seek="${spec%%:*}" count="${spec##*:}" \
            conv=notrunc status=none
    done
    [[ $(stat -c %s "$file") -eq $((mib * 1024 * 1024)) ]] || fail "make_sparse_image: wrong size"
}

# run_bounded SECS CMD... — run CMD with a time limit; a timeout is a failure.
run_bounded() {
    local secs=$1; shift
    local rc=0
    timeout --kill-after=5 "$secs" "$@" || rc=$?
    [[ $rc -ne 124 && $rc -ne 137 ]] || fail "timed out after ${secs}s: $*"
    return "$rc"
}

# assert_demo_gone WHAT — `vdstream demo` (run with TMPDIR set to a folder of its own) left
# no scratch folder in TMPDIR and no server, agent or guest whose command line names it.
assert_demo_gone() {
    local what=$1 leftover
    leftover=$(find "$TMPDIR" -mindepth 1 -maxdepth 1 | head -n1)
    [[ -z $leftover ]] || fail "$what left $leftover behind"
    if pgrep -f "$TMPDIR/vdstream-demo" >/dev/null; then
        fail "$what left processes running: $(pgrep -af "$TMPDIR/vdstream-demo")"
    fi
}

# rasterize_charts DIR — render every DIR/*.svg to PNG with rsvg-convert (a real SVG
# renderer) and check each PNG's signature and size; logs and returns when rsvg-convert
# is missing (Debian: librsvg2-bin; scripts/test installs it).
rasterize_charts() {
    local dir=$1 svg png n=0
    command -v rsvg-convert >/dev/null || { log "note: rsvg-convert missing: charts not rasterized"; return 0; }
    for svg in "$dir"/*.svg; do
        png=${svg%.svg}.png
        rsvg-convert -o "$png" "$svg" || fail "rsvg-convert refused $svg"
        [[ $(head -c 8 "$png" | od -An -tx1 | tr -d ' \n') == 89504e470d0a1a0a ]] || fail "$png is not a PNG"
        (($(stat -c %s "$png") > 2000)) || fail "$png is nearly empty ($(stat -c %s "$png") bytes)"
        n=$((n + 1))
    done
    ((n > 0)) || fail "no SVG chart in $dir"
    log "ok: rsvg-convert rendered $n charts in $dir"
}
