#!/usr/bin/env bash
# bench/console.sh — issue 22's two figures for the console, in one run:
#   1. the page's load time with --targets targets (default 1000), each with a fresh agent
#      report: Debian's chromium (Playwright) opens /console and the clock stops when the
#      targets table has every row and the live stream has delivered; median of --loads
#      fresh pages, beside the same page with 10 targets (the ratio is the cost of the
#      farm's size);
#   2. the server's CPU for the live updates: while every target reports once a second
#      (PUT /api/v1/targets/ID/agent, as agents do), the server's CPU with no event stream
#      open, with one (a console), and with ten, --runtime seconds each, A B C A B C over
#      --rounds rounds; CPU from /proc (user + system) over the wall time.
# The server listens on 127.0.0.1 (an open API: loopback, no token). Prints a Markdown
# report (and writes it to --out FILE).
#
# Usage: bench/console.sh [--targets 1000] [--loads 5] [--runtime 15] [--rounds 3] [--out FILE]
# Needs: chromium and the Python module playwright (scripts/test installs both).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"

targets=1000 loads=5 runtime=15 rounds=3 out='' args_given="$*"
while (($#)); do
    case $1 in
    --targets) targets=$2; shift ;;
    --loads) loads=$2; shift ;;
    --runtime) runtime=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --out) out=$2; shift ;;
    -h | --help) bench_help ;;
    *) bench_bad_arg "$1" ;;
    esac
    shift
done
need_rounds_runtime
[[ $targets =~ ^[1-9][0-9]*$ && $targets -le 10000 ]] || { echo "--targets must be 1 to 10000 (the server keeps 10,000 reports)" >&2; exit 2; }
[[ $loads =~ ^[1-9][0-9]*$ ]] || { echo "--loads must be a positive integer" >&2; exit 2; }
need_vdstream
need_cmds chromium curl
"$PY" -c 'import playwright' 2>/dev/null || { echo "console.sh: the Python module playwright is missing (run scripts/test once, or pip install playwright)" >&2; exit 2; }

work=$(mktemp -d "${TMPDIR:-/tmp}/vdstream-console.XXXXXX")
server_pid='' reporter_pid='' streams_pids=''
BENCH_PID_VARS="reporter_pid server_pid"
bench_cleanup_on_exit
trap 'r=$?; for p in $streams_pids; do kill "$p" 2>/dev/null || true; done; (exit "$r"); _bench_cleanup' EXIT
export VDSTREAM_STORE=$work/store

"$VDSTREAM_BIN" vdisk create golden --size 64M >/dev/null

# start_server — a server on a fresh port; sets server_pid and url.
start_server() {
    "$VDSTREAM_BIN" server --socket "$work/nbd.sock" --http 127.0.0.1:0 >"$work/server.log" 2>&1 </dev/null &
    server_pid=$!
    url=
    for _ in $(seq 200); do
        url=$(grep -Eo 'http://127\.0\.0\.1:[0-9]+' "$work/server.log" | head -n1 || true)
        [[ -n $url ]] && break
        sleep 0.1
    done
    [[ -n $url ]] || { cat "$work/server.log" >&2; echo "the server did not start" >&2; exit 1; }
}
start_server

# The reporter: adds targets t0..t(N-1) (first call) and then reports for each once a
# second, on four keep-alive connections, until killed; prints the reports it sent.
cat >"$work/reporter.py" <<'PY'
import http.client, json, random, sys, threading, time
url, n, add_only = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "add"
host, port = url.removeprefix("http://").rsplit(":", 1)
def conn():
    return http.client.HTTPConnection(host, int(port), timeout=30)
def call(c, method, path, body):
    c.request(method, path, body=json.dumps(body), headers={"Content-Type": "application/json"})
    r = c.getresponse()
    data = r.read()
    return r.status, data
if add_only:
    c = conn()
    for i in range(n):
        st, body = call(c, "POST", "/api/v1/targets", {"id": f"t{i}", "vdisk": "golden", "cache": "ram-overflow", "description": f"desk {i}"})
        assert st in (201, 409), (st, body)
    sys.exit(0)
sent = [0]
def worker(k, parts):
    c = conn()
    rnd = random.Random(k)
    t = time.monotonic()
    while True:
        for i in range(k, n, parts):
            g = rnd.uniform(100, 5000)
            doc = {"target": f"t{i}", "pid": 1000 + i, "state": "running", "started_unix_ms": 1, "updated_unix_ms": int(time.time() * 1000),
                   "socket": f"/run/vdstream/t{i}.sock", "vdisk": {"export": f"target/t{i}", "size": 67108864},
                   "server": {"endpoint": f"nbd://10.0.0.1:10809/target/t{i}", "connected": True, "endpoints": ["nbd://10.0.0.1:10809/target/t%d" % i], "retries": rnd.randint(0, 3)},
                   "cache": {"type": "ram-overflow", "ram_bytes": rnd.randint(0, 1 << 28), "ram_limit": 1 << 28, "file_bytes": rnd.randint(0, 1 << 26), "file_limit": 1 << 30, "capacity_bytes": (1 << 28) + (1 << 30), "limit_bytes": (1 << 28) + (1 << 30), "used_percent": 10.0},
                   "guest": {"iops": g, "bytes_per_sec": g * 4096, "read_ops": 1, "write_ops": 1, "read_bytes": 4096, "write_bytes": 4096},
                   "storage": {"iops": g / 10, "bytes_per_sec": g * 409.6, "read_ops": 1, "write_ops": 0, "read_bytes": 4096, "write_bytes": 0}}
            st, body = call(c, "PUT", f"/api/v1/targets/t{i}/agent", doc)
            assert st == 200, (st, body)
            sent[0] += 1
        t += 1.0
        time.sleep(max(0.0, t - time.monotonic()))
parts = 4
for k in range(parts):
    threading.Thread(target=worker, args=(k, parts), daemon=True).start()
start = time.monotonic()
try:
    while True:
        time.sleep(1)
        print(f"{sent[0]} {time.monotonic() - start:.1f}", flush=True)
except KeyboardInterrupt:
    pass
PY

cat >"$work/load.py" <<'PY'
import json, statistics, sys, time
sys.path.insert(0, sys.argv[4])
from chromium_flags import CHROMIUM, CHROMIUM_ARGS
from playwright.sync_api import sync_playwright
url, n, loads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
out = []
with sync_playwright() as p:
    b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    for _ in range(loads):
        # bypass_csp: the page's CSP forbids eval, which Playwright's polling uses.
        ctx = b.new_context(viewport={"width": 1366, "height": 860}, bypass_csp=True)
        page = ctx.new_page()
        page.goto(url + "/console")
        page.wait_for_function(f"document.querySelectorAll('#targets tbody tr').length === {n} && document.querySelector('#live').textContent === 'live'", timeout=60000, polling=10)
        ms = page.evaluate("performance.now()")
        out.append(ms)
        ctx.close()
    b.close()
print(json.dumps(out))
PY

cpu_secs() { awk -v hz="$(getconf CLK_TCK)" '{ printf "%.3f", ($14 + $15) / hz }' "/proc/$1/stat"; }

# The page's load time: 10 targets, then all of them (each with a fresh report).
"$PY" "$work/reporter.py" "$url" 10 add
"$PY" "$work/reporter.py" "$url" 10 report >"$work/reporter10.log" &
reporter_pid=$!
sleep 3
echo "loading the page with 10 targets ($loads loads)" >&2
load10=$("$PY" "$work/load.py" "$url" 10 "$loads" "$ROOT/tests/e2e")
kill "$reporter_pid"; wait "$reporter_pid" 2>/dev/null || true; reporter_pid=
echo "adding $targets targets" >&2
"$PY" "$work/reporter.py" "$url" "$targets" add
"$PY" "$work/reporter.py" "$url" "$targets" report >"$work/reporter.log" &
reporter_pid=$!
sleep 3
echo "loading the page with $targets targets ($loads loads)" >&2
loadn=$("$PY" "$work/load.py" "$url" "$targets" "$loads" "$ROOT/tests/e2e")

# The server's CPU with 0, 1 and 10 event streams open, reports arriving all along.
open_streams() {
    local k
    streams_pids=''
    for ((k = 0; k < $1; k++)); do
        curl -sN "$url/api/v1/events" >/dev/null 2>&1 &
        streams_pids+=" $!"
    done
}
close_streams() {
    local p
    for p in $streams_pids; do kill "$p" 2>/dev/null || true; wait "$p" 2>/dev/null || true; done
    streams_pids=''
}
cpu_rows=()
for ((r = 0; r < rounds; r++)); do
    for s in 0 1 10; do
        echo "round $((r + 1))/$rounds: $s event stream(s), ${runtime}s" >&2
        open_streams "$s"
        sleep 2
        c0=$(cpu_secs "$server_pid") n0=$(tail -n1 "$work/reporter.log" | cut -d' ' -f1) t0=$(date +%s.%N)
        sleep "$runtime"
        c1=$(cpu_secs "$server_pid") n1=$(tail -n1 "$work/reporter.log" | cut -d' ' -f1) t1=$(date +%s.%N)
        close_streams
        cpu_rows+=("$s $c0 $c1 $t0 $t1 $n0 $n1")
    done
done
kill "$reporter_pid"; wait "$reporter_pid" 2>/dev/null || true; reporter_pid=

table=$("$PY" - "$targets" "$load10" "$loadn" "${cpu_rows[@]}" <<'PY'
import json, statistics, sys
n = int(sys.argv[1])
l10, ln = json.loads(sys.argv[2]), json.loads(sys.argv[3])
m10, mn = statistics.median(l10), statistics.median(ln)
print("| page load (navigation to every row shown and the live stream delivering) | median ms | per load |")
print("| --- | ---: | --- |")
print(f"| 10 targets | {m10:.0f} | {', '.join(f'{x:.0f}' for x in l10)} |")
print(f"| {n} targets | {mn:.0f} | {', '.join(f'{x:.0f}' for x in ln)} |")
print()
print(f"{n} targets / 10 targets: **{mn / m10:.2f}×**.")
print()
rows = {}
for r in sys.argv[4:]:
    s, c0, c1, t0, t1, n0, n1 = r.split()
    wall = float(t1) - float(t0)
    rows.setdefault(int(s), []).append(((float(c1) - float(c0)) / wall * 100, (int(n1) - int(n0)) / wall))
print("| event streams open | server CPU, % of one core (median) | per round | reports a second |")
print("| ---: | ---: | --- | ---: |")
med = {}
for s in sorted(rows):
    cpu = [x[0] for x in rows[s]]
    med[s] = statistics.median(cpu)
    print(f"| {s} | {med[s]:.1f} | {', '.join(f'{x:.1f}' for x in cpu)} | {statistics.median(x[1] for x in rows[s]):.0f} |")
print()
print(f"The live updates for one console: {med[1] - med[0]:+.1f} points of a core ({med[1] / med[0]:.2f}× the server's CPU for the reports alone); for ten: {med[10] - med[0]:+.1f} points ({med[10] / med[0]:.2f}×).")
PY
)
report=$(
    echo "\`bench/console.sh ${args_given}\` — $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, $(chromium --version 2>/dev/null | head -n1), targets=$targets loads=$loads runtime=${runtime}s rounds=$rounds"
    echo
    echo "$table"
)
echo
echo "$report"
[[ -z $out ]] || echo "$report" >"$out"
