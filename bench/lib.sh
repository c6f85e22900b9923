# bench/lib.sh — pieces the benchmark scripts share: starting a peer's server is theirs,
# the settings below, waiting for a server to answer NBD, stopping it and cleaning up on
# exit are here. Set ROOT (the repository) before sourcing it.
# shellcheck shell=bash

# Settings; SHARED and VDSTREAM_BIN may come from the environment.
SHARED=${SHARED:-$ROOT/../shared}
JOBFILE=$SHARED/bench/vdi.fio
VDSTREAM_BIN=${VDSTREAM_BIN:-$ROOT/target/release/vdstream}
# Debian's libnbd bindings are only visible to the system interpreter (the scripts that
# source this file run their report code with it).
# shellcheck disable=SC2034
PY=/usr/bin/python3
export PATH=/usr/bin:$PATH

# need_jobfile, need_vdstream — exit 2, saying what to do, when the VDI job file or the
# vdstream binary is missing.
need_jobfile() {
    [[ -f $JOBFILE ]] || { echo "$(basename "$0"): job file $JOBFILE not found (set SHARED=)" >&2; exit 2; }
}
need_vdstream() {
    [[ -x $VDSTREAM_BIN ]] || { echo "$(basename "$0"): $VDSTREAM_BIN not built: cargo build --release -p vdstream" >&2; exit 2; }
}

# bench_help — prints the calling script's header comment (its --help) and exits 0.
# bench_bad_arg ARG — exits 2 naming an argument the script does not take.
bench_help() {
    sed -n '2,/^$/s/^# \{0,1\}//p' "$0"
    exit 0
}
bench_bad_arg() {
    echo "$(basename "$0"): unknown argument $1 (see --help)" >&2
    exit 2
}

# need_rounds_runtime — exits 2 unless $rounds and $runtime are positive whole numbers.
need_rounds_runtime() {
    [[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "--rounds must be a positive integer" >&2; exit 2; }
    [[ $runtime =~ ^[1-9][0-9]*$ ]] || { echo "--runtime must be whole seconds" >&2; exit 2; }
}

# need_cmds CMD... — exit 2, naming the first CMD that is not installed and how to get it
# (scripts/test installs every client tool the benchmarks use).
need_cmds() {
    local c
    for c in "$@"; do
        command -v "$c" >/dev/null ||
            { echo "$(basename "$0"): $c is not installed (run scripts/test once, or apt-get install the package that has it)" >&2; exit 2; }
    done
}

# stop_pid PID [TENTHS] — SIGTERM, wait up to TENTHS tenths of a second (default 100),
# then SIGKILL; reaps the process if it is our child.
stop_pid() {
    local pid=$1 tenths=${2:-100}
    [[ -n $pid ]] || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq "$tenths"); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
    wait "$pid" 2>/dev/null || true
}

# wait_nbd_ready PID SOCK LOG NAME SECS — poll (bounded) until the server PID answers an
# NBD handshake on SOCK. On failure prints why (with the server's LOG if it died), returns 1.
wait_nbd_ready() {
    local pid=$1 sock=$2 log=$3 name=$4 secs=$5
    local deadline=$((SECONDS + secs))
    while ((SECONDS < deadline)); do
        kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; return 1; }
        if [[ -S $sock ]] && timeout 5 nbdinfo --size "nbd+unix:///?socket=$sock" >/dev/null 2>&1; then
            return 0
        fi
        sleep 0.1
    done
    echo "$name did not become ready in $secs s" >&2
    return 1
}

# bench_cleanup_on_exit — on any exit, stop the processes whose pids are in the variables
# named by BENCH_PID_VARS (default: server_pid) and remove the caller's scratch folder
# $work; keeps the exit status.
bench_cleanup_on_exit() {
    trap _bench_cleanup EXIT
    trap 'exit 130' INT
    trap 'exit 143' TERM
}
_bench_cleanup() {
    local rc=$? var
    for var in ${BENCH_PID_VARS:-server_pid}; do
        stop_pid "${!var:-}" 50
    done
    # shellcheck disable=SC2154 # $work is the calling script's scratch folder
    rm -rf "$work"
    exit "$rc"
}

# make_store_chain DIR SIZE_MIB LAYERS PERCENT — a vDisk as the store keeps it, in DIR:
# base.qcow2 (SIZE_MIB of random data, converted from a raw file that is then removed)
# and v1.qcow2 … vLAYERS.qcow2, each backed by the one below (relative names), each
# holding PERCENT% of the disk in random 64 KiB writes (seeded: the same chain every
# time). Prints nothing; fails if qemu-img or qemu-io do.
make_store_chain() {
    local dir=$1 mib=$2 layers=$3 percent=$4 i below=base.qcow2
    head -c "$((mib * 1024 * 1024))" /dev/urandom >"$dir/base.raw"
    qemu-img convert -O qcow2 "$dir/base.raw" "$dir/base.qcow2"
    rm -f "$dir/base.raw"
    for ((i = 1; i <= layers; i++)); do
        qemu-img create -q -f qcow2 -b "$below" -F qcow2 "$dir/v$i.qcow2"
        /usr/bin/python3 - "$mib" "$percent" "$i" <<'PYEOF' | qemu-io -f qcow2 "$dir/v$i.qcow2" >/dev/null
import random, sys
mib, percent, seed = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
rng = random.Random(seed)
clusters = mib * 16
for _ in range(clusters * percent // 100):
    print(f"write -P {rng.randrange(1, 256)} {rng.randrange(clusters) * 65536} 64k")
PYEOF
        below=v$i.qcow2
    done
}

# make_tls_dirs DIR — a throw-away CA and two certificate folders in the layout qemu's
# tls-creds-x509, nbdkit, libnbd and vdstream read: DIR/server (ca-cert.pem,
# server-cert.pem, server-key.pem; names localhost and 127.0.0.1) and DIR/client (ca-cert.pem,
# client-cert.pem, client-key.pem; a target certificate for target id `bench`). ECDSA P-256,
# made with openssl by tests/e2e/certs-lib.sh. Prints nothing.
make_tls_dirs() {
    # shellcheck source=../tests/e2e/certs-lib.sh
    source "$(dirname "${BASH_SOURCE[0]}")/../tests/e2e/certs-lib.sh"
    make_pki "$1" bench
}

# wait_tcp_ready PID PORT LOG NAME SECS — poll (bounded) until PID listens on 127.0.0.1:PORT.
wait_tcp_ready() {
    local pid=$1 port=$2 log=$3 name=$4 secs=$5
    local deadline=$((SECONDS + secs))
    while ((SECONDS < deadline)); do
        kill -0 "$pid" 2>/dev/null || { cat "$log" >&2; return 1; }
        (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && return 0
        sleep 0.1
    done
    echo "$name did not listen on 127.0.0.1:$port in $secs s" >&2
    return 1
}
