# shellcheck shell=bash
# tests/e2e/pacing-lib.sh — a boot storm of simulated machines against a store server's boot
# pacing (`vdstream server --boot --max-booting N`), for test-boot-pacing-storm.sh and
# bench/boot-pacing.sh (source after lib.sh, store-lib.sh and server-lib.sh).
#
# A simulated machine does what the initramfs of a network-booted one does, minus the
# kernel: `vdstream target attach ID --server API --booting` (the agent asks the server for a
# boot place and waits while it is full), reads its whole vDisk through the agent's socket
# (compared with the image: a boot reads its root), says `vdstream target booted ID`, and
# stops its agent with SIGTERM (exit status 0 wanted).
#
#   pacing_setup N MIB        store_init, a MIB MiB vDisk "boot" (its bytes in $PACING_IMG) and
#                             N target records sim0..sim(N-1)
#   pacing_server MAX         a fresh store server with --boot --max-booting MAX; sets
#                             PACING_API (its API URL), SERVER_PID
#   pacing_storm N OUT        N machines at once against $PACING_API; waits (bounded) for
#                             all; OUT gets one line a machine: "ID START UP BOOTED RC WHY"
#                             (epoch seconds: start, its disk up, booted; RC 0 when all
#                             went well, else WHY); prints the storm's summary
#   pacing_overlap OUT        the most machines between "up" and "booted" at once
#   pacing_metric NAME        a figure of the server's /metrics

PACING_IMG=
PACING_API=

pacing_setup() {
    local n=$1 mib=$2 i
    store_init
    PACING_IMG=$E2E_TMP/boot.img
    head -c $((mib << 20)) /dev/urandom >"$PACING_IMG"
    vds vdisk import boot "$PACING_IMG" >/dev/null
    for ((i = 0; i < n; i++)); do
        vds target add "sim$i" --vdisk boot --cache ram-overflow --ram 8M >/dev/null || fail "target add sim$i failed"
    done
}

pacing_server() {
    local port
    port=$("$PY" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
    start_store_server --http "127.0.0.1:$port" --boot --max-booting "$1"
    PACING_API=http://127.0.0.1:$port
    local i
    for ((i = 0; i < 100; i++)); do
        curl -sf --max-time 2 "$PACING_API/api/v1/server" >/dev/null && return 0
        sleep 0.1
    done
    fail "the server's API did not answer on $PACING_API"
}

# pacing_machine I OUT — one simulated machine (run in the background).
pacing_machine() {
    local id=sim$1 out=$2 start up booted apid rc=0 why=ok i
    local sock=$VDSTREAM_RUN_DIR/$id.sock log=$E2E_TMP/agent-$id.log
    start=$(date +%s.%N)
    "$VDSTREAM_BIN" target attach "$id" --server "$PACING_API" --booting >"$log" 2>&1 </dev/null &
    apid=$!
    # Bounded: the storm's own limit ends a machine that never got a place.
    for ((i = 0; i < 6000; i++)); do
        [[ -S $sock ]] && break
        kill -0 "$apid" 2>/dev/null || break
        sleep 0.1
    done
    up=$(date +%s.%N)
    if [[ ! -S $sock ]]; then
        rc=1 why="no-disk"
    elif ! nbdcopy "nbd+unix:///?socket=$sock" - 2>>"$log" | cmp -s - "$PACING_IMG"; then
        rc=1 why="read-differs"
    fi
    booted=$(date +%s.%N)
    if ((rc == 0)) && ! "$VDSTREAM_BIN" target booted "$id" --server "$PACING_API" >>"$log" 2>&1; then
        rc=1 why="booted-failed"
    fi
    # (An agent that ended by itself is an error: its status is kept.)
    kill -TERM "$apid" 2>/dev/null || true
    local arc=0
    wait "$apid" || arc=$?
    if ((rc == 0 && arc != 0)); then rc=1 why="agent-exit-$arc"; fi
    echo "$id $start $up $booted $rc $why" >>"$out"
}

pacing_storm() {
    local n=$1 out=$2 i t0 pids=()
    : >"$out"
    agent_env
    mkdir -p "$VDSTREAM_RUN_DIR" "$VDSTREAM_CACHE_DIR"
    t0=$(date +%s.%N)
    for ((i = 0; i < n; i++)); do
        pacing_machine "$i" "$out" &
        pids+=("$!")
    done
    for i in "${pids[@]}"; do wait "$i" || true; done
    "$PY" - "$out" "$t0" "$n" <<'PYEOF'
import sys
rows = [l.split() for l in open(sys.argv[1])]
t0, n = float(sys.argv[2]), int(sys.argv[3])
bad = [r for r in rows if r[4] != "0"]
end = max(float(r[3]) for r in rows)
waits = sorted(float(r[2]) - float(r[1]) for r in rows)
print(f"{len(rows)} of {n} machines ended, {len(bad)} with an error; all booted in {end - t0:.1f} s; "
      f"time to a disk: median {waits[len(waits) // 2]:.1f} s, longest {waits[-1]:.1f} s")
for r in bad[:10]:
    print("  failed:", " ".join(r))
PYEOF
}

pacing_overlap() {
    "$PY" - "$1" <<'PYEOF'
import sys
ev = []
for l in open(sys.argv[1]):
    r = l.split()
    ev += [(float(r[2]), 1), (float(r[3]), -1)]
cur = peak = 0
for _, d in sorted(ev, key=lambda e: (e[0], e[1])):
    cur += d
    peak = max(peak, cur)
print(peak)
PYEOF
}

pacing_metric() {
    curl -sf --max-time 5 "$PACING_API/metrics" | awk -v m="$1" '$1 == m { print $2 }'
}
