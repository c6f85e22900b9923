# shellcheck shell=bash
# tests/e2e/rebalance-lib.sh — a farm of three store servers on one store (loopback) and a
# hundred agents that list all three, for test-rebalance.sh and bench/rebalance.sh (source
# after lib.sh, store-lib.sh, server-lib.sh, agent-lib.sh and fio-verify.sh).
#
# The servers are a, b and c, each with its own NBD socket ($E2E_TMP/srv-NAME.sock) and an
# API port chosen once by rb_setup: agents list the three API URLs before b and c run, and
# a server started again under its name is where it was.
#
#   rb_setup N MIB          store_init, a MIB MiB vDisk "rb" of random bytes (its bytes in
#                           $RB_IMG), N target records t0..t(N-1) (ram-overflow, --ram 8M)
#                           and "pin" (cache type server: its cache lives in one server's
#                           memory, so it never moves); ports for a, b and c
#   rb_new_run              forget the agents and loops of a run that ended
#   rb_spawn NAME [ARGS]    start server NAME (--name, --http, --rebalance-interval
#                           $RB_INTERVAL, then ${RB_SERVER_ARGS[@]} and ARGS) and return
#   rb_ready NAME           wait (bounded) until it lists its exports and its API answers
#   rb_server NAME [ARGS]   both
#   rb_stop NAME [SECS]     SIGTERM; returns its exit status (124: it had to be killed)
#   rb_agents ID...         `vdstream target attach ID --server A --server B --server C` each,
#                           all at once; waits (bounded) until every one is connected
#   rb_agents_stop [--count]
#                           SIGTERM to every agent; fails unless each exits 0 (--count:
#                           sets RB_BAD_STOPS to how many did not, in this shell: the
#                           agents are its children)
#   rb_wait_spread SECS T0 NAME...
#                           poll (bounded) the sessions of every running server until every
#                           target is connected to one server, each NAME holds its fair
#                           share (targets / number of NAMEs) within $RB_TOLERANCE percent
#                           and every other running server none; prints the seconds since
#                           T0 (an $EPOCHREALTIME) and the counts ("12.3 a=34 b=34 c=33"),
#                           or why not and returns 1
#   rb_counts               "a=34 b=34 c=33" now (servers not running: left out)
#   rb_snapshot OUT         each agent as its status file says: "ID ALIVE FAILOVERS
#                           CONNECTED GAVE_UP STATE ENDPOINT"
#   rb_moves BEFORE AFTER   between two snapshots: every agent alive, running, connected,
#                           none gave up, none moved (failovers) more than once; prints how
#                           many moved and writes their ids to AFTER.moved; returns 1 if not
#   rb_get NAME PATH EXPR   python EXPR over `j`, the JSON of GET PATH on server NAME
#   rb_metric NAME METRIC   a figure of server NAME's /metrics
#   rb_fio_loops ID...      fio with crc32c verification through each agent, one run after
#                           the other (run_fio_verify) until rb_loops_stop
#   rb_reader_loops ID...   compare 4 random MiB read through each agent with $RB_IMG, every
#                           second, until rb_loops_stop
#   rb_loops_alive          fails, with its log, if a loop ended (a failed run)
#   rb_loops_stop           lets each loop finish its run; fails unless every one exits 0
#   rb_report               the farm now, for a failure: counts, each server's balance,
#                           agents not connected

RB_INTERVAL=${RB_INTERVAL:-3}
RB_TOLERANCE=${RB_TOLERANCE:-25}
RB_SERVER_ARGS=()
RB_IMG=
RB_AGENTS=    # file: "ID PID" a line, every agent started
RB_IDS=()
RB_LOOPS=()   # "PID LOG" of each fio or reader loop
RB_STOP=      # created to end the loops
RB_BAD_STOPS=0
declare -A RB_PORT=() RB_API=() RB_PID=() RB_SOCK=() RB_LOG=() RB_STARTS=() RB_APID=()

rb_setup() {
    local n=$1 mib=$2 i ports
    store_init
    RB_IMG=$E2E_TMP/rb.img
    RB_AGENTS=$E2E_TMP/agents.txt
    RB_STOP=$E2E_TMP/loops.stop
    : >"$RB_AGENTS"
    head -c $((mib << 20)) /dev/urandom >"$RB_IMG"
    vds vdisk import rb "$RB_IMG" >/dev/null
    for ((i = 0; i < n; i++)); do
        vds target add "t$i" --vdisk rb --cache ram-overflow --ram 8M >/dev/null || fail "target add t$i failed"
    done
    vds target add pin --vdisk rb --cache server >/dev/null || fail "target add pin failed"
    # Three ports free at once (held together, so they differ).
    ports=$("$PY" -c 'import socket
s = [socket.socket() for _ in range(3)]
for x in s: x.bind(("127.0.0.1", 0))
print(" ".join(str(x.getsockname()[1]) for x in s))')
    read -r "RB_PORT[a]" "RB_PORT[b]" "RB_PORT[c]" <<<"$ports"
    for i in a b c; do
        RB_API[$i]=http://127.0.0.1:${RB_PORT[$i]}
        RB_SOCK[$i]=$E2E_TMP/srv-$i.sock
        RB_STARTS[$i]=0
    done
}

# rb_new_run — forget the agents and loops of a run that ended (the bench's next run).
rb_new_run() {
    : >"$RB_AGENTS"
    RB_IDS=()
    RB_LOOPS=()
    rm -f "$RB_STOP"
}

rb_spawn() {
    local name=$1
    shift
    RB_STARTS[$name]=$((RB_STARTS[$name] + 1))
    RB_LOG[$name]=$E2E_TMP/server-$name-${RB_STARTS[$name]}.log
    log "starting: vdstream server --store $STORE --socket ${RB_SOCK[$name]} --name $name --http 127.0.0.1:${RB_PORT[$name]} --rebalance-interval $RB_INTERVAL ${RB_SERVER_ARGS[*]} $*"
    "$VDSTREAM_BIN" server --store "$STORE" --socket "${RB_SOCK[$name]}" --name "$name" \
        --http "127.0.0.1:${RB_PORT[$name]}" --rebalance-interval "$RB_INTERVAL" \
        "${RB_SERVER_ARGS[@]}" "$@" >"${RB_LOG[$name]}" 2>&1 </dev/null &
    RB_PID[$name]=$!
    E2E_PIDS+=("$!")
    E2E_SERVER_PIDS+=("$!")
    E2E_SERVER_LOGS+=("${RB_LOG[$name]}")
}

rb_ready() {
    local name=$1 deadline=$((SECONDS + READY_SECS)) rc
    while ((SECONDS < deadline)); do
        if ! kill -0 "${RB_PID[$name]}" 2>/dev/null; then
            wait "${RB_PID[$name]}" 2>/dev/null && rc=0 || rc=$?
            fail "server $name exited (status $rc) before it was ready: $(tail -n 20 "${RB_LOG[$name]}")"
        fi
        if [[ -S ${RB_SOCK[$name]} ]] && timeout 5 nbdinfo --list "nbd+unix:///?socket=${RB_SOCK[$name]}" >/dev/null 2>&1 &&
            curl -sf --max-time 2 "${RB_API[$name]}/api/v1/server" >/dev/null; then
            return 0
        fi
        sleep 0.1
    done
    fail "server $name did not list its exports and answer on ${RB_API[$name]} within ${READY_SECS}s"
}

rb_server() {
    rb_spawn "$@"
    rb_ready "$1"
}

rb_stop() {
    local rc=0
    stop_server "${RB_PID[$1]}" "${2:-30}" || rc=$?
    RB_PID[$1]=
    return "$rc"
}

# rb_running — "NAME=API-URL" of each server whose process runs, one a line.
rb_running() {
    local name
    for name in a b c; do
        [[ -n ${RB_PID[$name]:-} ]] && kill -0 "${RB_PID[$name]}" 2>/dev/null && echo "$name=${RB_API[$name]}"
    done
    return 0
}

rb_agents() {
    local id
    agent_env
    mkdir -p "$VDSTREAM_RUN_DIR" "$VDSTREAM_CACHE_DIR"
    log "starting $# agents: vdstream target attach ID --server ${RB_API[a]} --server ${RB_API[b]} --server ${RB_API[c]}"
    for id in "$@"; do
        "$VDSTREAM_BIN" target attach "$id" --server "${RB_API[a]}" --server "${RB_API[b]}" --server "${RB_API[c]}" \
            >"$E2E_TMP/agent-$id.log" 2>&1 </dev/null &
        RB_APID[$id]=$!
        track_pid "$!"
        RB_IDS+=("$id")
        echo "$id $!" >>"$RB_AGENTS"
    done
    "$PY" - "$VDSTREAM_RUN_DIR" "$RB_AGENTS" 60 "$@" <<'PYEOF' || fail "the agents did not all attach"
import json, os, sys, time
run, agents, secs, want = sys.argv[1], sys.argv[2], float(sys.argv[3]), set(sys.argv[4:])
pids = dict(l.split() for l in open(agents))
deadline = time.monotonic() + secs
def alive(pid):
    try:
        os.kill(int(pid), 0)
        return True
    except OSError:
        return False
while True:
    dead, waiting = [], []
    for i in sorted(want):
        if not alive(pids[i]):
            dead.append(i)
            continue
        try:
            s = json.load(open(f"{run}/{i}.status.json"))
            up = os.path.exists(f"{run}/{i}.sock") and s["state"] == "running" and s["server"]["connected"]
        except (OSError, ValueError, KeyError):
            up = False
        if not up:
            waiting.append(i)
    if dead:
        for i in dead[:5]:
            print(f"---- agent {i} exited; its log:", file=sys.stderr)
            sys.stderr.write("".join(open(os.path.join(os.path.dirname(agents), f"agent-{i}.log")).readlines()[-15:]))
        sys.exit(f"{len(dead)} agents exited at attach: {' '.join(dead[:20])}")
    if not waiting:
        sys.exit(0)
    if time.monotonic() > deadline:
        sys.exit(f"{len(waiting)} of {len(want)} agents not connected within {secs:.0f} s: {' '.join(waiting[:20])}")
    time.sleep(0.5)
PYEOF
    log "$# agents attached and connected"
}

rb_agents_stop() {
    local count=${1:-} id pid rc i bad=()
    for id in "${RB_IDS[@]}"; do
        kill -TERM "${RB_APID[$id]}" 2>/dev/null || true
    done
    for id in "${RB_IDS[@]}"; do
        pid=${RB_APID[$id]}
        for ((i = 0; i < 300; i++)); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null
        rc=0
        wait "$pid" 2>/dev/null || rc=$?
        ((rc == 0)) || bad+=("$id:$rc")
    done
    # shellcheck disable=SC2034 # read by the caller
    RB_BAD_STOPS=${#bad[@]}
    [[ $count != --count ]] || return 0
    ((${#bad[@]} == 0)) || fail "agents that did not exit 0 on SIGTERM (id:status): ${bad[*]}; the first one's log: $(tail -n 15 "$E2E_TMP/agent-${bad[0]%%:*}.log")"
    log "ok: all ${#RB_IDS[@]} agents stopped on SIGTERM with exit status 0"
}

rb_wait_spread() {
    local secs=$1 t0=$2
    shift 2
    local sharers
    sharers=$(IFS=,; echo "$*")
    # shellcheck disable=SC2046 # one argument per running server
    "$PY" - "$secs" "${t0/,/.}" "$RB_TOLERANCE" "$sharers" "$RB_AGENTS" $(rb_running) <<'PYEOF'
import json, sys, time, urllib.request
secs, t0, tol = float(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]) / 100
sharers = sys.argv[4].split(",")
targets = {l.split()[0] for l in open(sys.argv[5])}
servers = dict(a.split("=", 1) for a in sys.argv[6:])
deadline = time.monotonic() + secs
share = len(targets) / len(sharers)
while True:
    counts, where, errors = {}, {}, []
    for name, url in sorted(servers.items()):
        try:
            with urllib.request.urlopen(url + "/api/v1/sessions", timeout=3) as r:
                mine = {s["target"] for s in json.load(r) if s.get("target") in targets}
        except Exception as e:
            errors.append(f"{name}: {e}")
            continue
        counts[name] = len(mine)
        for t in mine:
            where.setdefault(t, []).append(name)
    missing = sorted(targets - where.keys())
    twice = sorted(t for t, s in where.items() if len(s) > 1)
    ok = (not errors and not missing and not twice
          and all(n in counts and abs(counts[n] - share) <= tol * share for n in sharers)
          and all(counts.get(n, 0) == 0 for n in servers if n not in sharers))
    state = " ".join(f"{n}={counts.get(n, '?')}" for n in sorted(servers))
    if ok:
        print(f"{time.time() - t0:.1f} {state}")
        sys.exit(0)
    if time.monotonic() > deadline:
        print(f"after {time.time() - t0:.1f} s, not each of {','.join(sharers)} within {tol * 100:.0f}% of {share:.1f} "
              f"(and the others empty): {state}; {len(missing)} not connected {missing[:10]}; "
              f"on two servers {twice[:10]}; API errors {errors}")
        sys.exit(1)
    time.sleep(0.5)
PYEOF
}

rb_counts() {
    # shellcheck disable=SC2046 # one argument per running server
    "$PY" - $(rb_running) <<'PYEOF'
import json, sys, urllib.request
out = []
for a in sys.argv[1:]:
    name, url = a.split("=", 1)
    try:
        with urllib.request.urlopen(url + "/api/v1/sessions", timeout=3) as r:
            out.append(f"{name}={len({s['target'] for s in json.load(r) if s.get('target')})}")
    except Exception as e:
        out.append(f"{name}=({e})")
print(" ".join(out))
PYEOF
}

rb_snapshot() {
    "$PY" - "$VDSTREAM_RUN_DIR" "$RB_AGENTS" "$1" <<'PYEOF'
import json, os, sys
run, agents, out = sys.argv[1:4]
with open(out, "w") as f:
    for line in open(agents):
        i, pid = line.split()
        try:
            os.kill(int(pid), 0)
            alive = 1
        except OSError:
            alive = 0
        try:
            s = json.load(open(f"{run}/{i}.status.json"))
            sv = s["server"]
            f.write(f"{i} {alive} {sv['failovers']} {int(sv['connected'])} {sv['gave_up']} {s['state'].replace(' ', '-')} {sv['endpoint']}\n")
        except (OSError, ValueError, KeyError) as e:
            f.write(f"{i} {alive} -1 0 -1 no-status {type(e).__name__}\n")
PYEOF
}

rb_moves() {
    "$PY" - "$1" "$2" <<'PYEOF'
import sys
before = {l.split()[0]: l.split() for l in open(sys.argv[1])}
after = [l.split() for l in open(sys.argv[2])]
bad, moved = [], []
for i, alive, fo, conn, gave_up, state, *ep in after:
    fo0 = int(before[i][2]) if i in before else 0
    if alive != "1":
        bad.append(f"{i}: the agent exited")
    elif state != "running" or conn != "1" or gave_up != "0":
        bad.append(f"{i}: state {state}, connected {conn}, gave up {gave_up} ({' '.join(ep)})")
    elif int(fo) - fo0 > 1:
        bad.append(f"{i}: moved {int(fo) - fo0} times (failovers {fo0} -> {fo})")
    if int(fo) > fo0:
        moved.append(i)
open(sys.argv[2] + ".moved", "w").write("".join(f"{i}\n" for i in moved))
print(len(moved))
for b in bad[:20]:
    print("  " + b, file=sys.stderr)
sys.exit(1 if bad else 0)
PYEOF
}

rb_get() {
    curl -sf --max-time 5 "${RB_API[$1]}$2" >"$E2E_TMP/get.json" || fail "GET $2 on server $1 failed"
    json_get "$E2E_TMP/get.json" "$3"
}

rb_metric() {
    curl -sf --max-time 5 "${RB_API[$1]}/metrics" | awk -v m="$2" '$1 == m { print $2 }'
}

# rb_fio_loop ID — fio runs through agent ID until $RB_STOP exists (in the background).
rb_fio_loop() {
    local id=$1 k=0
    while [[ ! -e $RB_STOP ]]; do
        k=$((k + 1))
        URI="nbd+unix:///?socket=$VDSTREAM_RUN_DIR/$id.sock" run_fio_verify "$id" --rw=randrw --rwmixwrite=50 --bs=4k --size=24m --iodepth=4 \
            --rate_iops=100 --number_ios=600
        echo "$E2E_NAME: fio run $k through $id: ok"
    done
}

# rb_reader_loop ID — reads 4 random MiB through agent ID and compares them with the image,
# every second, until $RB_STOP exists (in the background).
rb_reader_loop() {
    local id=$1 k=0
    while [[ ! -e $RB_STOP ]]; do
        k=$((k + 1))
        RB_IMG=$RB_IMG timeout 60 nbdsh -u "nbd+unix:///?socket=$VDSTREAM_RUN_DIR/$id.sock" -c '
import os, random
size = h.get_size()
with open(os.environ["RB_IMG"], "rb") as f:
    for _ in range(4):
        off = random.randrange(size >> 20) << 20
        f.seek(off)
        assert h.pread(1 << 20, off) == f.read(1 << 20), f"the MiB at {off} differs from the image"
' || fail "read $k through $id failed or differs from the image"
        echo "$E2E_NAME: read $k through $id: ok"
        sleep 1
    done
}

# rb_loops KIND ID... — rb_KIND_loop (fio or reader) through each agent, in the background.
rb_loops() {
    local kind=$1 id
    shift
    rm -f "$RB_STOP"
    for id in "$@"; do
        "rb_${kind}_loop" "$id" >"$E2E_TMP/loop-$kind-$id.log" 2>&1 &
        track_pid "$!"
        RB_LOOPS+=("$! $E2E_TMP/loop-$kind-$id.log")
    done
}

rb_fio_loops() { rb_loops fio "$@"; }
rb_reader_loops() { rb_loops reader "$@"; }

rb_loops_alive() {
    local l
    for l in "${RB_LOOPS[@]}"; do
        kill -0 "${l%% *}" 2>/dev/null || fail "a loop ended: $(tail -n 30 "${l#* }")"
    done
    log "ok: ${#RB_LOOPS[@]} fio and reader loops still running, none failed"
}

rb_loops_stop() {
    local l pid i rc runs=0
    touch "$RB_STOP"
    for l in "${RB_LOOPS[@]}"; do
        pid=${l%% *}
        for ((i = 0; i < 900; i++)); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
        kill -0 "$pid" 2>/dev/null && fail "a loop did not end its run within 90 s: $(tail -n 20 "${l#* }")"
        rc=0
        wait "$pid" || rc=$?
        ((rc == 0)) || fail "a loop failed (exit $rc): $(tail -n 30 "${l#* }")"
        runs=$((runs + $(grep -c ': ok$' "${l#* }" || true)))
    done
    log "ok: ${#RB_LOOPS[@]} fio and reader loops ended with exit status 0 ($runs runs, all verified)"
}

rb_report() {
    local name
    {
        echo "---- the farm now: $(rb_counts)"
        for name in a b c; do
            [[ -n ${RB_PID[$name]:-} ]] || continue
            kill -0 "${RB_PID[$name]}" 2>/dev/null || continue
            echo "server $name: balance $(curl -s --max-time 3 "${RB_API[$name]}/api/v1/server" | "$PY" -c 'import json,sys; print(json.load(sys.stdin).get("balance"))' 2>&1)"
            echo "server $name: farm $(curl -s --max-time 3 "${RB_API[$name]}/api/v1/farm")"
        done
        rb_snapshot "$E2E_TMP/report.txt"
        echo "agents not connected or not running:"
        awk '$2 != 1 || $4 != 1 || $6 != "running"' "$E2E_TMP/report.txt" | head -n 10
        echo "----"
    } >&2
}
