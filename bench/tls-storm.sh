#!/usr/bin/env bash
# bench/tls-storm.sh — a hostile crowd does not starve a good client: a target keeps its
# IOPS while --attempts connection attempts with certificates of a foreign CA hammer the
# same TLS server. The server is `vdstream serve-image --memory 1G --listen 127.0.0.1:PORT
# --tls require --tls-certificates SERVER_DIR`; the good client is fio's nbd engine under the
# VDI profile (shared/bench/vdi.fio) with a certificate of the right CA; the crowd is
# --parallel threads of a Python client that each, --attempts times in all, connect from
# 127.0.0.2 (another address than the good client's 127.0.0.1, as another machine would),
# ask NBD_OPT_STARTTLS, and offer a foreign certificate (the server must refuse every one).
# The server runs with its default handshake penalties (--handshake-penalty 10: after 10
# refused handshakes within a minute an address's connections are closed at accept);
# --no-penalty runs it with --handshake-penalty 0, to see what they save.
# Each round runs fio alone, then fio during the storm (the storm starts a second before
# fio and is stopped when fio ends, or ends when its attempts are spent). Prints IOPS
# alone, IOPS during the storm, their ratio (goal >= 0.8), and the storm's tally: attempts
# made, refused, accepted (must be 0).
#
# Usage: bench/tls-storm.sh [--size 1g] [--runtime 15] [--rounds 2] [--attempts 10000]
#                           [--parallel 8] [--no-penalty] [--out FILE]
# Environment: SHARED, VDSTREAM_BIN, TMPDIR.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"

size=1g runtime=15 rounds=2 attempts=10000 parallel=8 out='' penalty_args=()
args_given="$*"
while (($#)); do
    case $1 in
    --size) size=$2; shift ;;
    --runtime) runtime=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --attempts) attempts=$2; shift ;;
    --parallel) parallel=$2; shift ;;
    --no-penalty) penalty_args=(--handshake-penalty 0) ;;
    --out) out=$2; shift ;;
    -h | --help) bench_help ;;
    *) bench_bad_arg "$1" ;;
    esac
    shift
done
need_rounds_runtime
need_jobfile
need_vdstream
need_cmds fio openssl
[[ $attempts =~ ^[1-9][0-9]*$ && $parallel =~ ^[1-9][0-9]?$ ]] || { echo "--attempts: a positive number; --parallel: 1 to 99" >&2; exit 2; }

work=$(mktemp -d "${TMPDIR:-/tmp}/vdstream-bench-storm.XXXXXX")
server_pid='' storm_pid=''
BENCH_PID_VARS="storm_pid server_pid"
bench_cleanup_on_exit
make_tls_dirs "$work/certs"
make_tls_dirs "$work/foreign"
mkdir -p "$work/home/.pki" && ln -s "$work/certs/client" "$work/home/.pki/libnbd"

port=$((20000 + RANDOM % 30000))
"$VDSTREAM_BIN" serve-image --memory 1G --listen "127.0.0.1:$port" --tls require \
    --tls-certificates "$work/certs/server" "${penalty_args[@]}" >"$work/server.log" 2>&1 </dev/null &
server_pid=$!
wait_tcp_ready "$server_pid" "$port" "$work/server.log" vdstream 20

# run_fio NAME — the VDI profile as the good target (see bench/tls.sh for why unshare).
run_fio() {
    HOME=$work/home unshare -U --map-user=1000 --map-group=1000 fio "$JOBFILE" --ioengine=nbd \
        --uri="nbds://127.0.0.1:$port/" --size="$size" --runtime="$runtime" \
        --output-format=json --output="$work/$1.json" >"$work/$1.log" 2>&1 ||
        { cat "$work/$1.log" "$work/server.log" >&2; echo "fio failed ($1)" >&2; exit 1; }
}

# cpu_secs PID — user + system CPU seconds PID has used so far.
cpu_secs() { awk -v hz="$(getconf CLK_TCK)" '{ printf "%.2f\n", ($14 + $15) / hz }' "/proc/$1/stat"; }

for ((r = 0; r < rounds; r++)); do
    echo "round $((r + 1))/$rounds: fio alone" >&2
    c0=$(cpu_secs "$server_pid")
    run_fio "alone.$r"
    c1=$(cpu_secs "$server_pid")
    echo "round $((r + 1))/$rounds: fio during $attempts foreign-certificate attempts" >&2
    "$PY" - "$port" "$work/foreign/client" "$work/certs/client/ca-cert.pem" "$attempts" "$parallel" \
        >"$work/tally.$r.json" 2>"$work/tally.$r.log" <<'PYEOF' &
import json, socket, ssl, struct, sys, threading
port, cdir, ca, attempts, parallel = int(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
ctx.load_verify_locations(ca)              # the server is genuine ...
ctx.load_cert_chain(f"{cdir}/client-cert.pem", f"{cdir}/client-key.pem")   # ... our certificate is not
lock, tally = threading.Lock(), {"attempts": 0, "refused": 0, "closed": 0, "accepted": 0, "other": 0}
IHAVEOPT = 0x49484156454F5054

def exact(s, n):
    b = b""
    while len(b) < n:
        c = s.recv(n - len(b))
        if not c:
            raise EOFError
        b += c
    return b

def attempt():
    with socket.create_connection(("127.0.0.1", port), timeout=10, source_address=("127.0.0.2", 0)) as s:
        try:
            exact(s, 18)
        except (EOFError, ConnectionResetError):
            return "closed"                                   # closed at accept: no greeting
        s.sendall(struct.pack(">I", 3) + struct.pack(">QII", IHAVEOPT, 5, 0))
        exact(s, 20)
        try:
            t = ctx.wrap_socket(s, server_hostname="127.0.0.1")
            t.sendall(struct.pack(">QII", IHAVEOPT, 2, 0))   # NBD_OPT_ABORT
            exact(t, 20)                                      # an answer: the server let us in
            return "accepted"
        except (ssl.SSLError, EOFError, ConnectionResetError, BrokenPipeError):
            return "refused"

def run():
    while True:
        with lock:
            if tally["attempts"] >= attempts:
                return
            tally["attempts"] += 1
        try:
            outcome = attempt()
        except Exception as e:  # a timeout or refused connection is a result too
            print(f"attempt failed: {e!r}", file=sys.stderr)
            outcome = "other"
        with lock:
            tally[outcome] += 1

import time
started = time.monotonic()
threads = [threading.Thread(target=run, daemon=True) for _ in range(parallel)]
for t in threads:
    t.start()
try:
    for t in threads:
        t.join()
except KeyboardInterrupt:   # fio finished first: report what was done
    pass
import resource
with lock:
    tally["secs"] = round(time.monotonic() - started, 1)
    ru = resource.getrusage(resource.RUSAGE_SELF)
    tally["cpu"] = round(ru.ru_utime + ru.ru_stime, 1)
    print(json.dumps(tally))
PYEOF
    storm_pid=$!
    sleep 1
    c2=$(cpu_secs "$server_pid")
    run_fio "storm.$r"
    c3=$(cpu_secs "$server_pid")
    echo "{\"alone\": $(awk -v a="$c0" -v b="$c1" 'BEGIN { print b - a }'), \"storm\": $(awk -v a="$c2" -v b="$c3" 'BEGIN { print b - a }')}" >"$work/server-cpu.$r.json"
    if kill -0 "$storm_pid" 2>/dev/null; then
        echo "(the storm outlasted fio; stopping it)" >&2
        kill -INT "$storm_pid" 2>/dev/null || true
    fi
    wait "$storm_pid" 2>/dev/null || true
    storm_pid=
done

table=$("$PY" - "$work" "$rounds" <<'PYEOF'
import json, statistics, sys
work, rounds = sys.argv[1], int(sys.argv[2])
def total(path):
    text = open(path).read()
    job = json.loads(text[text.index("{"):])["jobs"][0]
    if job["error"]:
        sys.exit(f"fio reported error {job['error']} in {path}")
    return job["read"]["iops"] + job["write"]["iops"]
print("| round | IOPS alone | IOPS during the storm | ratio | storm: attempts, refused by TLS, closed at accept, accepted, other | storm's seconds | storm client's CPU s | server CPU s: fio alone, during the storm |")
print("| --- | ---: | ---: | ---: | --- | ---: | ---: | --- |")
ratios = []
for r in range(rounds):
    a, s = total(f"{work}/alone.{r}.json"), total(f"{work}/storm.{r}.json")
    ratios.append(s / a)
    t = json.load(open(f"{work}/tally.{r}.json"))
    if t["accepted"]:
        sys.exit(f"round {r + 1}: the server let {t['accepted']} foreign certificates in")
    cpu = json.load(open(f"{work}/server-cpu.{r}.json"))
    print(f"| {r + 1} | {a:.0f} | {s:.0f} | {s / a:.2f} | {t['attempts']}, {t['refused']}, {t['closed']}, {t['accepted']}, {t['other']} | {t['secs']} | {t['cpu']} | {cpu['alone']:.1f}, {cpu['storm']:.1f} |")
print()
print(f"- IOPS during the storm / alone: **{statistics.median(ratios):.2f}** (median); goal >= 0.8")
PYEOF
)
refusals=$(grep -c -i "tls\|certificate" "$work/server.log" || true)
header="### TLS: a storm of foreign certificates beside a working target

\`bench/tls-storm.sh ${args_given}\` — $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, $(fio --version),
load average at the end: $(cut -d' ' -f1-3 /proc/loadavg); server log lines about TLS or
certificates: $refusals.
"
printf '%s\n%s\n' "$header" "$table"
if [[ -n $out ]]; then
    printf '%s\n%s\n' "$header" "$table" >"$out"
    echo "wrote $out" >&2
fi
