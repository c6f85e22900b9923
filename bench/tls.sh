#!/usr/bin/env bash
# bench/tls.sh — what TLS costs, and vdstream beside its peers with TLS on the same
# certificates: the VDI profile (shared/bench/vdi.fio: 4 jobs x QD16, 4 KiB, 80% writes,
# 90% random) with fio's nbd engine over TCP on 127.0.0.1, one fio connection per job. Every
# peer serves the same raw image file of --size (page cache on, as each does by default):
#   vdstream          vdstream serve-image FILE --listen 127.0.0.1:PORT
#   vdstream-tls      the same with --tls require --tls-certificates SERVER_DIR
#   qemu-nbd-tls      qemu-nbd -t -e 8 --object tls-creds-x509,dir=SERVER_DIR,endpoint=server,
#                     verify-peer=on --tls-creds (qemu's TLS: gnutls)
#   nbdkit-tls        nbdkit --tls=require --tls-certificates=SERVER_DIR --tls-verify-peer file
#   qemu-nbd, nbdkit  the same without TLS (only when named in --peers)
#   agent, agent-tls  through an agent (only when named in --peers): `vdstream server
#                     --listen 127.0.0.1:PORT` on a store holding the image as vDisk
#                     `golden` (agent-tls: with --tls require), and `vdstream target attach
#                     bench --server nbd[s]://127.0.0.1:PORT/vdisk/golden --cache device-disk`
#                     (agent-tls: with the target certificate); fio talks to the agent's unix
#                     socket, so what TLS costs here is the agent's link to the server
# fio connects with nbds://127.0.0.1:PORT/ (libnbd: the server's certificate is checked
# against the CA and its name; the client shows a target certificate). fio's nbd engine
# does not let a URI name a certificate folder (libnbd refuses local files in URIs there),
# so fio runs as a non-root user of a user namespace (unshare -U) with HOME pointing at a
# folder whose .pki/libnbd is the client folder: libnbd's default for non-root users. The certificates (ECDSA P-256, one throw-away CA) are made by openssl
# (bench/lib.sh make_tls_dirs). Each round runs every peer, the order rotating; prints the
# median total IOPS per peer, vdstream-tls / vdstream (the cost of TLS) and vdstream-tls /
# the better TLS peer.
#
# Usage: bench/tls.sh [--size 1g] [--runtime 15] [--rounds 3]
#                     [--peers vdstream,vdstream-tls,qemu-nbd-tls,nbdkit-tls] [--out FILE]
# Environment: SHARED (default: the `shared` folder beside the repo), VDSTREAM_BIN, TMPDIR.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"

size=1g runtime=15 rounds=3 out='' peers=vdstream,vdstream-tls,qemu-nbd-tls,nbdkit-tls
args_given="$*"
while (($#)); do
    case $1 in
    --size) size=$2; shift ;;
    --runtime) runtime=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --peers) peers=$2; shift ;;
    --out) out=$2; shift ;;
    -h | --help) bench_help ;;
    *) bench_bad_arg "$1" ;;
    esac
    shift
done
need_rounds_runtime
need_jobfile
need_vdstream
need_cmds fio nbdkit qemu-nbd openssl
IFS=, read -r -a peer_list <<<"$peers"

work=$(mktemp -d "${TMPDIR:-/tmp}/vdstream-bench-tls.XXXXXX")
server_pid='' agent_pid=''
BENCH_PID_VARS="agent_pid server_pid"
bench_cleanup_on_exit
make_tls_dirs "$work/certs"
sdir=$work/certs/server
mkdir -p "$work/home/.pki" && ln -s "$work/certs/client" "$work/home/.pki/libnbd"
echo "making the image: $size of random data" >&2
head -c "$(numfmt --from=iec "${size^^}")" /dev/urandom >"$work/disk.img"

if [[ ,$peers, == *,agent* ]]; then
    export VDSTREAM_STORE=$work/store VDSTREAM_RUN_DIR=$work/run VDSTREAM_CACHE_DIR=$work/cache
    "$VDSTREAM_BIN" vdisk import golden "$work/disk.img" >/dev/null
    "$VDSTREAM_BIN" target add bench --vdisk golden --cache device-disk >/dev/null
fi

# free_port — a TCP port on 127.0.0.1 nothing listens on (bounded tries).
free_port() {
    local p
    for _ in $(seq 50); do
        p=$((20000 + RANDOM % 30000))
        (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null || { echo "$p"; return 0; }
    done
    echo "no free port found" >&2
    return 1
}

# start_peer NAME PORT — sets server_pid and uri.
start_peer() {
    local name=$1 port=$2 img=$work/disk.img cmd
    local tls=(--object "tls-creds-x509,id=tls0,dir=$sdir,endpoint=server,verify-peer=on" --tls-creds tls0)
    uri="nbds://127.0.0.1:$port/"
    case $name in
    vdstream) cmd=("$VDSTREAM_BIN" serve-image --format raw "$img" --listen "127.0.0.1:$port"); uri="nbd://127.0.0.1:$port/" ;;
    vdstream-tls) cmd=("$VDSTREAM_BIN" serve-image --format raw "$img" --listen "127.0.0.1:$port" --tls require --tls-certificates "$sdir") ;;
    qemu-nbd) cmd=(qemu-nbd -t -e 8 -f raw -b 127.0.0.1 -p "$port" -x '' "$img"); uri="nbd://127.0.0.1:$port/" ;;
    qemu-nbd-tls) cmd=(qemu-nbd -t -e 8 -f raw -b 127.0.0.1 -p "$port" -x '' "${tls[@]}" "$img") ;;
    nbdkit) cmd=(nbdkit -f -i 127.0.0.1 -p "$port" file "$img"); uri="nbd://127.0.0.1:$port/" ;;
    nbdkit-tls) cmd=(nbdkit -f -i 127.0.0.1 -p "$port" --tls=require "--tls-certificates=$sdir" --tls-verify-peer file "$img") ;;
    agent | agent-tls) start_agent "$name" "$port"; return ;;
    *) echo "unknown peer $name (see --help)" >&2; return 1 ;;
    esac
    "${cmd[@]}" >"$work/$name.server.log" 2>&1 </dev/null &
    server_pid=$!
    wait_tcp_ready "$server_pid" "$port" "$work/$name.server.log" "$name" 20
}

# start_agent NAME PORT — vdstream server on the store, and the agent in front of it.
start_agent() {
    local name=$1 port=$2 scheme=nbd tls=() agent_tls=()
    if [[ $name == agent-tls ]]; then
        scheme=nbds tls=(--tls require --tls-certificates "$sdir") agent_tls=(--tls-certificates "$work/certs/client")
    fi
    "$VDSTREAM_BIN" server --listen "127.0.0.1:$port" --socket "$work/server.sock" "${tls[@]}" \
        >"$work/$name.server.log" 2>&1 </dev/null &
    server_pid=$!
    wait_tcp_ready "$server_pid" "$port" "$work/$name.server.log" "$name server" 20
    "$VDSTREAM_BIN" target attach bench --server "$scheme://127.0.0.1:$port/vdisk/golden" --cache device-disk \
        "${agent_tls[@]}" >"$work/$name.agent.log" 2>&1 </dev/null &
    agent_pid=$!
    wait_nbd_ready "$agent_pid" "$work/run/bench.sock" "$work/$name.agent.log" "$name" 60
    uri="nbd+unix:///?socket=$work/run/bench.sock"
}

n=${#peer_list[@]}
for ((r = 0; r < rounds; r++)); do
    for ((k = 0; k < n; k++)); do
        p=${peer_list[(k + r) % n]}
        port=$(free_port)
        echo "round $((r + 1))/$rounds: $p (size=$size runtime=${runtime}s)" >&2
        start_peer "$p" "$port" || { echo "failed to start $p" >&2; exit 1; }
        HOME=$work/home unshare -U --map-user=1000 --map-group=1000 fio "$JOBFILE" --ioengine=nbd --uri="$uri" --size="$size" --runtime="$runtime" \
            --output-format=json --output="$work/$p.$r.json" >"$work/$p.$r.fio.log" 2>&1 ||
            { cat "$work/$p.$r.fio.log" "$work/$p.server.log" >&2 || true; echo "fio failed against $p" >&2; exit 1; }
        stop_pid "$agent_pid"
        stop_pid "$server_pid"
        server_pid='' agent_pid=''
        rm -rf "$work/run" "$work/cache"
        sleep 1
    done
done

table=$("$PY" - "$work" "$rounds" "${peer_list[@]}" <<'PYEOF'
import json, statistics, sys
work, rounds, peers = sys.argv[1], int(sys.argv[2]), sys.argv[3:]

def total(path):
    text = open(path).read()
    job = json.loads(text[text.index("{"):])["jobs"][0]
    if job["error"]:
        sys.exit(f"fio reported error {job['error']} in {path}")
    return job["read"]["iops"] + job["write"]["iops"]

runs = {p: [total(f"{work}/{p}.{i}.json") for i in range(rounds)] for p in peers}
med = {p: statistics.median(v) for p, v in runs.items()}
print("| peer | total IOPS (median) | per round |")
print("| --- | ---: | --- |")
for p in peers:
    print(f"| {p} | {med[p]:.0f} | {', '.join(f'{x:.0f}' for x in runs[p])} |")
print()
def per_round(a, b):
    return [runs[a][i] / runs[b][i] for i in range(rounds)]
if "agent" in med and "agent-tls" in med:
    rr = per_round("agent-tls", "agent")
    print(f"- agent-tls / agent: **{statistics.median(rr):.2f}** (per round {', '.join(f'{x:.2f}' for x in rr)}); goal >= 0.85")
if "vdstream" in med and "vdstream-tls" in med:
    rr = per_round("vdstream-tls", "vdstream")
    print(f"- vdstream-tls / vdstream: **{statistics.median(rr):.2f}** (per round {', '.join(f'{x:.2f}' for x in rr)}); goal >= 0.85")
tls_peers = [p for p in ("qemu-nbd-tls", "nbdkit-tls") if p in med]
if "vdstream-tls" in med and tls_peers:
    best = [max(runs[p][i] for p in tls_peers) for i in range(rounds)]
    rr = [runs["vdstream-tls"][i] / best[i] for i in range(rounds)]
    print(f"- vdstream-tls / the better of {', '.join(tls_peers)}: **{statistics.median(rr):.2f}** (per round {', '.join(f'{x:.2f}' for x in rr)}); goal >= 1.5")
PYEOF
)
header="### TLS: the VDI profile over TCP on 127.0.0.1

\`bench/tls.sh ${args_given}\` — $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, $(fio --version),
$(nbdkit --version | head -n1), $(qemu-nbd --version | head -n1), load average at the end:
$(cut -d' ' -f1-3 /proc/loadavg); every peer serves the same raw file, certificates from one
openssl CA (ECDSA P-256).
"
printf '%s\n%s\n' "$header" "$table"
if [[ -n $out ]]; then
    printf '%s\n%s\n' "$header" "$table" >"$out"
    echo "wrote $out" >&2
fi
