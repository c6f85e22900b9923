#!/usr/bin/env bash
# Boot pacing (issue 38): 200 simulated machines boot at once against a server with
# --max-booting 50. A machine is what a network-booted one's initramfs does: its agent asks
# for a boot place (`target attach --booting`) and waits while the server is full, then it
# reads its whole vDisk through the agent (compared with the image), says `target booted`,
# and its agent stops cleanly (pacing-lib.sh). Every machine boots, none gets an error; at
# no moment were more than 50 in their boot window (the server's own peak, and the
# machines' overlap as they saw it); the pacing did work (machines waited, the peak reached
# the limit); every window was closed by its machine, none by the timeout; the server's
# API and /metrics show it, and its console in Chromium says "booting 50 of 50, 5 waiting"
# once the places are held full.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=server-lib.sh
source "$E2E_DIR/server-lib.sh"
# shellcheck source=agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
# shellcheck source=pacing-lib.sh
source "$E2E_DIR/pacing-lib.sh"
require nbdcopy cmp curl chromium
"$PY" -c 'import playwright' 2>/dev/null || fail "the Python module playwright is missing (scripts/test installs it with pip)"
require_vdstream
e2e_init
N=${VDSTREAM_PACING_MACHINES:-200}
MAX=${VDSTREAM_PACING_MAX:-50}

pacing_setup "$N" 16
pacing_server "$MAX"
# The console (Chromium) during the storm: its server line says how many boot and wait.
"$PY" "$E2E_DIR/console_line.py" "$PACING_API" '#sum-server' "booting [0-9]+ of $MAX, [0-9]+ waiting" 120 \
    "$E2E_TMP/console.ready" >"$E2E_TMP/console.txt" 2>&1 &
console_pid=$!
track_pid "$console_pid"
# The storm starts once the page shows the server line (Chromium takes a few seconds).
for ((i = 0; i < 600; i++)); do
    [[ -e $E2E_TMP/console.ready ]] && break
    kill -0 "$console_pid" 2>/dev/null || fail "the console did not open: $(tail -n 3 "$E2E_TMP/console.txt")"
    sleep 0.1
done
[[ -e $E2E_TMP/console.ready ]] || fail "the console did not show its server line within 60 s"
pacing_storm "$N" "$E2E_TMP/storm.txt" | tee "$E2E_TMP/summary.txt"
# What the console showed during the storm is logged, with its timeline when it never showed
# machines waiting; the assertion on the console is made below on a state held still.
if wait "$console_pid"; then
    log "the console during the storm said: $(tail -n 1 "$E2E_TMP/console.txt")"
else
    log "the console during the storm never showed machines waiting; what it showed:"
    sed 's/^/    /' "$E2E_TMP/console.txt" >&2
fi

bad=$(awk '$5 != 0' "$E2E_TMP/storm.txt" | wc -l)
ended=$(wc -l <"$E2E_TMP/storm.txt")
assert_eq "machines that ended" "$ended" "$N"
assert_eq "machines with an error" "$bad" 0
log "ok: all $N machines booted, read their whole vDisk, and their agents stopped cleanly"

peak=$(pacing_metric vdstream_boot_booting_peak)
seen=$(pacing_overlap "$E2E_TMP/storm.txt")
waits=$(pacing_metric vdstream_boot_waits_total)
log "the server's peak of machines in their boot window: $peak; as the machines saw it: $seen; answers that said wait: $waits"
((peak <= MAX)) || fail "the server had $peak machines in their boot window at once, more than --max-booting $MAX"
((seen <= MAX)) || fail "$seen machines were booting at once as they saw it, more than --max-booting $MAX"
((peak >= MAX * 4 / 5)) || fail "the peak $peak stayed far below $MAX: the storm did not fill the boot places"
((waits > 0)) || fail "no machine was told to wait"
grep -q "waiting: [0-9]* booting (at most $MAX at once)" "$E2E_TMP"/agent-sim*.log || fail "no agent said on its console that it waits"
log "ok: at most $MAX at once; the agents said 'waiting: N booting'"

assert_eq "windows closed by their machine" "$(pacing_metric vdstream_boot_booted_total)" "$N"
assert_eq "windows closed by the timeout" "$(pacing_metric vdstream_boot_expired_total)" 0
assert_eq "machines in their boot window after the storm" "$(pacing_metric vdstream_boot_booting)" 0
doc=$(curl -sf --max-time 5 "$PACING_API/api/v1/server")
assert_eq "GET /api/v1/server's boot pacing" "$(json_get <(echo "$doc") 'str((j["boot"]["max_booting"], j["boot"]["booted_total"], j["boot"]["booting_peak"]))')" "($MAX, $N, $peak)"
grep -q "waits: $MAX booting (at most $MAX)" "$SERVER_LOG" || fail "the server's log does not say who waited"
log "ok: the API, /metrics and the log show the pacing"

# An unknown id gets no place (the pacer keeps records' windows only), and a place asked
# while the server is empty is given at once.
code=$(curl -s -o "$E2E_TMP/unknown.json" -w '%{http_code}' --max-time 5 "$PACING_API/boot/admit/nobody")
assert_eq "GET /boot/admit of an unknown id" "$code" 404
code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$PACING_API/boot/admit/sim0")
assert_eq "GET /boot/admit on an empty server" "$code" 200

# The console on a state held still: every place taken (sim0 has one already), and five
# machines told to wait (a waiting machine stays queued for 30 s without asking again).
for ((i = 1; i < MAX; i++)); do
    code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$PACING_API/boot/admit/sim$i")
    [[ $code == 200 ]] || fail "GET /boot/admit/sim$i while places are free: HTTP $code, want 200"
done
for ((i = MAX; i < MAX + 5; i++)); do
    code=$(curl -s -o /dev/null -w '%{http_code}' --max-time 5 "$PACING_API/boot/admit/sim$i")
    [[ $code == 503 ]] || fail "GET /boot/admit/sim$i once every place is taken: HTTP $code, want 503"
done
line=$("$PY" "$E2E_DIR/console_line.py" "$PACING_API" '#sum-server' "booting $MAX of $MAX, 5 waiting" 30 2>"$E2E_TMP/console-held.txt") ||
    fail "the console did not show $MAX booting and 5 waiting: $(tail -n 12 "$E2E_TMP/console-held.txt")"
log "ok: the console said: $line"
rc=0
stop_server "$SERVER_PID" 15 || rc=$?
assert_eq "server exit status" "$rc" 0
