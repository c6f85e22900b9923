#!/usr/bin/env bash
# bench/migrate.sh — live migration of a running guest between two qemus, the baseline a
# vdstream migration is compared with: the guest's disk is one plain NBD export that both
# qemus open (shared storage, nothing to hand over), so what is measured is qemu's own cost.
# The guest (the golden image, tests/e2e/vm-lib.sh) writes and verifies all along
# (vdstest=loop: 1 MiB written, sync, caches dropped, read back; vdstest.keep=1 where the
# image has it); it migrates A to B, then B to A (a new `-incoming` qemu each hop), --rounds
# times. Peers (the export):
#   nbdkit     nbdkit file plugin serving a raw copy of golden.img on a unix socket
#   qemu-nbd   qemu-nbd -f raw -t --shared=8 serving the same kind of copy
#   vdstream   (with vdstream-quiet, vdstream-busy, and vdstream-tls: the agents linked by TCP
#              with TLS, as between hosts) each side its own agent, the cache
#              handed over by `vdstream target migrate` (case_vdstream below); quiet and
#              busy: the guest pauses 3 s or not at all between its rounds
#   trace      (not in the default list) one nbdkit per side over one raw copy, each with
#              the log filter, and the source paused at pre-switchover for a mark: shows,
#              per migration, which NBD requests the destination sent before `completed`,
#              the source's last request before switch-over and when it hung up. The
#              pause is counted in its downtime: not a baseline figure.
# Per migration: qemu's downtime, total time, setup time and RAM sent (query-migrate); per
# peer the medians. The guest
# must end with `VDSTEST DONE status=ok` and `KERNEL-IO-ERRORS n=0`, and the image must pass
# e2fsck -fn afterwards. run_case (below) is where a vdstream case plugs in: each side its
# own disk URI (its agent's socket) and hooks around each hop.
#
# Usage: bench/migrate.sh [--rounds 2] [--secs S] [--peers nbdkit,qemu-nbd,vdstream,vdstream-quiet,vdstream-busy,vdstream-tls[,trace]]
#   --secs S   how long the guest's write loop runs (default 30 + 10 per migration); it must
#              outlast every migration (a guest that powers off first fails the run)
# Environment: VDSTREAM_VM_ACCEL (tcg|kvm; default: probed), VDSTREAM_E2E_KEEP=1 (keep the
# scratch folder: serial logs, qemu logs, *.migrate.json), TMPDIR.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"
rounds=2 secs='' peers=nbdkit,qemu-nbd,vdstream,vdstream-quiet,vdstream-busy,vdstream-tls
args_given="$*"
while (($#)); do
    case $1 in
    --rounds) rounds=$2; shift ;;
    --secs) secs=$2; shift ;;
    --peers) peers=$2; shift ;;
    -h | --help) bench_help ;;
    *) bench_bad_arg "$1" ;;
    esac
    shift
done
[[ $rounds =~ ^[1-9][0-9]*$ ]] || { echo "--rounds must be a positive integer" >&2; exit 2; }
hops=$((2 * rounds))
secs=${secs:-$((30 + 10 * hops))}
[[ $secs =~ ^[1-9][0-9]*$ ]] || { echo "--secs must be whole seconds" >&2; exit 2; }
need_cmds qemu-system-x86_64 nbdkit qemu-nbd nbdinfo e2fsck

# The end-to-end helpers start the guests and stop everything on exit.
# shellcheck source=../tests/e2e/lib.sh
source "$ROOT/tests/e2e/lib.sh"
# shellcheck source=../tests/e2e/vm-lib.sh
source "$E2E_DIR/vm-lib.sh"
# shellcheck source=../tests/e2e/migrate-lib.sh
source "$E2E_DIR/migrate-lib.sh"
VM_SECS=$((secs + 180)) # each qemu's bound: boot, the loop, the power-off
e2e_init
require_vm
accel=$(vm_accel)
APPEND="vdstest=loop vdstest.keep=1 vdstest.secs=$secs"
RESULTS=$E2E_TMP/results.jsonl
: >"$RESULTS"

drive() { echo "file=$1,format=raw,if=virtio"; }
# mark CASE HOP WHAT — a wall-clock mark in $MARKS, in the nbdkit log filter's format.
MARKS=$E2E_TMP/marks
mark() { echo "$1 $2 $3 $(date '+%F %T.%6N')" >>"$MARKS"; }

# run_case NAME URI_A URI_B [BEFORE_HOP] [SWITCHOVER] [AFTER_HOP] — one guest on side a's
# disk URI_A, migrated live $hops times, a to b to a ..., side b's disk being URI_B (the
# baseline gives the same export twice). The hooks (function names, "" for none) get
# FROM TO HOP (sides a|b, hop 1..$hops):
#   BEFORE_HOP  before the destination qemu starts (e.g. start the destination's agent)
#   SWITCHOVER  while the source is paused before switch-over, guest stopped and disks still
#               active (migrate_vm's MIGRATE_SWITCHOVER_HOOK; also gets SRC_VM DST_URI):
#               e.g. hand the write cache over; qemu's downtime then includes it
#   AFTER_HOP   after the source qemu quit (e.g. stop the source's agent)
# Appends one JSON line per migration to $RESULTS and the moments dest-start, migrate,
# completed and quit (the source's) of each hop to $MARKS; fails unless the guest, on its
# last destination, ends with DONE status=ok and no kernel I/O error.
run_case() {
    local name=$1 uri_a=$2 uri_b=$3 before=${4:-} switch=${5:-} after=${6:-}
    local hop from=a to=b vm=$name-0 next uri
    start_vm_qmp "$vm" "$(drive "$uri_a")" "$APPEND"
    wait_serial "$vm" '^VDSTEST ROUND 2 ok' 180
    for ((hop = 1; hop <= hops; hop++)); do
        serial_has "$vm" '^VDSTEST DONE' && fail "$name: the guest finished before hop $hop: raise --secs (now $secs)"
        [[ -z $before ]] || "$before" "$from" "$to" "$hop"
        next=$name-$hop
        if [[ $to == a ]]; then uri=$uri_a; else uri=$uri_b; fi
        mark "$name" "$hop" dest-start
        start_vm_qmp "$next" "$(drive "$uri")" "$APPEND" "unix:$E2E_TMP/$next.mig"
        mark "$name" "$hop" migrate
        if [[ -n $MIGRATE_WITH ]]; then
            "$MIGRATE_WITH" "$vm" "unix:$E2E_TMP/$next.mig" "$from" "$to" "$hop"
        else
            MIGRATE_SWITCHOVER_HOOK=${switch:+$switch $from $to $hop}
            migrate_vm "$vm" "unix:$E2E_TMP/$next.mig" >/dev/null
            MIGRATE_SWITCHOVER_HOOK=
        fi
        mark "$name" "$hop" completed
        "${QMP[@]}" "$E2E_TMP/$next.qmp" wait-status running --timeout 30 >/dev/null ||
            fail "$name hop $hop: the destination does not run"
        mark "$name" "$hop" quit
        quit_vm "$vm"
        [[ -z $after ]] || "$after" "$from" "$to" "$hop"
        # The guest goes on writing and verifying on the destination (its console continues
        # in the destination's serial log).
        wait_serial "$next" '^VDSTEST ROUND [0-9]+ (ok|bad)' 60
        "$PY" - "$E2E_TMP/$vm.migrate.json" "$name" "$hop" "$from" "$to" >>"$RESULTS" <<'PYEOF'
import json, sys
m = json.load(open(sys.argv[1]))
m.update(peer=sys.argv[2], hop=int(sys.argv[3]), route=f"{sys.argv[4]}>{sys.argv[5]}")
print(json.dumps(m))
PYEOF
        log "$name hop $hop ($from to $to): $(tail -n1 "$RESULTS")"
        vm=$next
        if [[ $from == a ]]; then from=b to=a; else from=a to=b; fi
    done
    wait_migrated_vm "$vm" "$VM_SECS"
    guest_console "$name-0" $(for ((hop = 1; hop <= hops; hop++)); do echo "$name-$hop"; done) |
        tr -d '\r' >"$E2E_TMP/$name.console"
    ! grep -q '^VDSTEST ROUND [0-9]* bad' "$E2E_TMP/$name.console" || fail "$name: a round read back other bytes than it wrote"
    log "ok: $name: $hops migrations, $(grep -c '^VDSTEST ROUND [0-9]* ok' "$E2E_TMP/$name.console") rounds ok, $(grep -a 'KERNEL-IO-ERRORS\|LOOP VERIFIED' "$E2E_TMP/$name.console" | paste -sd' ')"
}

# case_shared PEER — the baseline: a fresh raw copy of golden.img served by PEER on a unix
# socket, both sides' qemus on that one export; e2fsck of the copy afterwards.
case_shared() {
    local peer=$1 img=$E2E_TMP/$1.img sock=$E2E_TMP/$1.sock pid
    cp --sparse=always "$GOLDEN/golden.img" "$img"
    case $peer in
    nbdkit) nbdkit -f -U "$sock" file "file=$img" >"$E2E_TMP/$peer.log" 2>&1 </dev/null & ;;
    qemu-nbd) qemu-nbd -f raw -t --shared=8 -k "$sock" "$img" >"$E2E_TMP/$peer.log" 2>&1 </dev/null & ;;
    *) fail "unknown peer $peer (nbdkit, qemu-nbd)" ;;
    esac
    pid=$!
    track_pid "$pid"
    E2E_SERVER_LOGS+=("$E2E_TMP/$peer.log")
    wait_ready "$pid" "nbd+unix:///?socket=$sock"
    run_case "$peer" "nbd+unix:///?socket=$sock" "nbd+unix:///?socket=$sock"
    stop_server "$pid" 15 || fail "$peer did not stop cleanly"
    e2fsck -fn "$img" >"$E2E_TMP/$peer.fsck" 2>&1 || { cat "$E2E_TMP/$peer.fsck" >&2; fail "$peer: e2fsck -fn found errors"; }
    rm -f "$img"
}

# case_trace — two nbdkit instances (log filter) over one raw copy, side a's and side b's;
# the switch-over hook only marks the moment. Prints what the logs show per migration.
trace_switchover() { mark trace "$3" pre-switchover; }
case_trace() {
    local img=$E2E_TMP/trace.img side pids=()
    cp --sparse=always "$GOLDEN/golden.img" "$img"
    for side in a b; do
        nbdkit -f -U "$E2E_TMP/trace-$side.sock" --filter=log file "file=$img" \
            "logfile=$E2E_TMP/trace-$side.log" >"$E2E_TMP/trace-$side.out" 2>&1 </dev/null &
        pids+=($!)
        track_pid $!
        wait_ready $! "nbd+unix:///?socket=$E2E_TMP/trace-$side.sock"
    done
    run_case trace "nbd+unix:///?socket=$E2E_TMP/trace-a.sock" "nbd+unix:///?socket=$E2E_TMP/trace-b.sock" \
        "" trace_switchover ""
    for side in 0 1; do stop_server "${pids[side]}" 15 || fail "trace: nbdkit did not stop cleanly"; done
    e2fsck -fn "$img" >"$E2E_TMP/trace.fsck" 2>&1 || { cat "$E2E_TMP/trace.fsck" >&2; fail "trace: e2fsck -fn found errors"; }
    rm -f "$img"
    "$PY" - "$MARKS" "$E2E_TMP/trace-a.log" "$E2E_TMP/trace-b.log" >"$E2E_TMP/trace.report" <<'PYEOF'
import re, sys
from datetime import datetime
T = lambda s: datetime.strptime(s, "%Y-%m-%d %H:%M:%S.%f")
marks = {}
for line in open(sys.argv[1]):
    case, hop, what, d, t = line.split()
    if case == "trace":
        marks.setdefault(int(hop), {})[what] = T(f"{d} {t}")
def requests(path):  # (time, action, rest) of each request and Disconnect, not the replies
    out = []
    for line in open(path):
        m = re.match(r"(\S+ \S+) connection=\d+ (Read|Write|Flush|Trim|Zero|Extents|Cache|Disconnect)\b(.*)", line)
        if m:
            out.append((T(m[1]), m[2], m[3].replace(" ...", "").strip()))
    return out
logs = {"a": requests(sys.argv[2]), "b": requests(sys.argv[3])}
ms = lambda d: round(d.total_seconds() * 1000)
for hop, m in sorted(marks.items()):
    src, dst = ("a", "b") if hop % 2 else ("b", "a")
    early = [r for r in logs[dst] if m["dest-start"] <= r[0] < m["completed"] and r[1] != "Disconnect"]
    print(f"hop {hop} ({src} to {dst}): destination requests before completed: {len(early)}"
          + "".join(f"\n    {r[1]} {r[2]} at {ms(r[0] - m['migrate']):+d} ms from migrate" for r in early))
    before = [r for r in logs[src] if r[0] < m["pre-switchover"] and r[1] != "Disconnect"]
    last = before[-1]
    paused = [r for r in logs[src] if m["pre-switchover"] <= r[0] < m["completed"]]
    print(f"    source: last request before pre-switchover: {last[1]} {last[2]} ({ms(m['pre-switchover'] - last[0])} ms before);"
          f" requests while paused and at switch-over: {', '.join(r[1] for r in paused) or 'none'}")
    gone = [r for r in logs[src] if r[1] == "Disconnect" and r[0] >= m["migrate"]]
    tail = [r[1] for r in logs[src] if m["completed"] <= r[0] and (not gone or r[0] < gone[0][0])]
    print(f"    source: hung up {ms(gone[0][0] - m['quit']):+d} ms from its quit"
          f" ({ms(gone[0][0] - m['completed'])} ms after completed); requests after completed: {', '.join(tail) or 'none'}")
PYEOF
}

# case_vdstream NAME PAUSE — vdstream: golden.img served read-only by `vdstream
# serve-image`, each side its own agent (its own run and cache folders) with a ram-overflow
# cache of 64 MiB, the guest's disk on its side's agent socket; each hop starts the
# destination's agent with --incoming and runs `vdstream target migrate --qmp --to` (which
# pauses qemu before its switch-over for the final delta: counted in qemu's downtime). The
# guest pauses PAUSE seconds between its rounds (vdstest.pause: 3 a quiet guest, 0 a busy
# one). Adds the handover's figures to each row.
MIGRATE_WITH=
vds_pids=()
# VDS_LINK=tls: the agents link over TCP with TLS (both show the target's certificate), as
# between two hosts; otherwise through the source's migration socket.
VDS_LINK=
vds_attach() { # SIDE [--incoming SOURCE]
    local side=$1; shift
    mkdir -p "$E2E_TMP/$side"
    if [[ $VDS_LINK == tls ]]; then
        if [[ ! -e $E2E_TMP/tls-$side/client-cert.pem ]]; then
            [[ -e $E2E_TMP/ca/ca-cert.pem ]] || VDSTREAM_CA=$E2E_TMP/ca "$VDSTREAM_BIN" pki init --farm bench >/dev/null
            VDSTREAM_CA=$E2E_TMP/ca "$VDSTREAM_BIN" pki issue target vm --out "$E2E_TMP/tls-$side" >/dev/null
        fi
        set -- "$@" --migrate-listen 127.0.0.1:0 --migrate-certificates "$E2E_TMP/tls-$side"
    fi
    VDSTREAM_RUN_DIR=$E2E_TMP/$side/run VDSTREAM_CACHE_DIR=$E2E_TMP/$side/cache \
        "$VDSTREAM_BIN" target attach vm --server "nbd+unix:///?socket=$E2E_TMP/golden.sock" \
        --cache ram-overflow --ram 64M "$@" >>"$E2E_TMP/agent-$side.log" 2>&1 </dev/null &
    if [[ $side == a ]]; then vds_pids[0]=$!; else vds_pids[1]=$!; fi
    track_pid $!
    wait_ready $! "nbd+unix:///?socket=$E2E_TMP/$side/run/vm.sock"
}
vds_pid_of() { if [[ $1 == a ]]; then echo "${vds_pids[0]}"; else echo "${vds_pids[1]}"; fi; }
vds_source() { # SIDE — where a destination reaches the source agent on SIDE
    if [[ $VDS_LINK == tls ]]; then
        grep -o 'live migrations from this agent: .* and tls://127\.0\.0\.1:[0-9]*' "$E2E_TMP/agent-$1.log" | tail -n 1 | grep -o 'tls://.*'
    else
        echo "$E2E_TMP/$1/run/vm.migrate"
    fi
}
vds_before_hop() { vds_attach "$2" --incoming "$(vds_source "$1")"; }
vds_migrate() { # SRC_VM DST_URI FROM TO HOP
    VDSTREAM_RUN_DIR=$E2E_TMP/$3/run "$VDSTREAM_BIN" target migrate vm --qmp "$E2E_TMP/$1.qmp" --to "$2" \
        --json >"$E2E_TMP/$1.vds.json" || fail "vdstream target migrate (hop $5) failed"
    "$PY" - "$E2E_TMP/$1.vds.json" >"$E2E_TMP/$1.migrate.json" <<'PYEOF'
import json, sys
j = json.load(open(sys.argv[1]))
q, h = j["qemu"], j["handover"]
print(json.dumps({"status": q["status"], "total-time": q["total_ms"], "downtime": q["downtime_ms"],
                  "setup-time": q["setup_ms"], "ram-transferred": q["ram_bytes"],
                  "rounds": h["rounds"], "held": h["held_bytes"], "moved": h["data_bytes"],
                  "wire": h["wire_bytes"], "final": h["final_bytes"], "fenced_ms": h["fenced_ms"]}))
PYEOF
}
vds_after_hop() {
    local pid i
    pid=$(vds_pid_of "$1")
    for ((i = 0; i < 100; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    wait "$pid" 2>/dev/null || fail "the source agent on side $1 did not end cleanly after the handover"
}
case_vdstream() {
    local name=$1 pause=$2 spid side
    rm -rf "$E2E_TMP/a" "$E2E_TMP/b"
    "$VDSTREAM_BIN" serve-image "$GOLDEN/golden.img" --read-only --socket "$E2E_TMP/golden.sock" \
        >"$E2E_TMP/golden-server.log" 2>&1 </dev/null &
    spid=$!
    track_pid "$spid"
    wait_ready "$spid" "nbd+unix:///?socket=$E2E_TMP/golden.sock"
    vds_attach a
    local append=$APPEND
    MIGRATE_WITH=vds_migrate APPEND="$APPEND vdstest.pause=$pause"
    run_case "$name" "nbd+unix:///?socket=$E2E_TMP/a/run/vm.sock" "nbd+unix:///?socket=$E2E_TMP/b/run/vm.sock" \
        vds_before_hop "" vds_after_hop
    MIGRATE_WITH='' APPEND=$append
    # The last destination's disk: e2fsck of what it serves.
    side=$([[ $((hops % 2)) == 0 ]] && echo a || echo b)
    qemu-img convert -f raw -O raw "nbd+unix:///?socket=$E2E_TMP/$side/run/vm.sock" "$E2E_TMP/$name.img"
    e2fsck -fn "$E2E_TMP/$name.img" >"$E2E_TMP/$name.fsck" 2>&1 || { cat "$E2E_TMP/$name.fsck" >&2; fail "$name: e2fsck -fn found errors"; }
    rm -f "$E2E_TMP/$name.img"
    stop_server "$(vds_pid_of "$side")" 15 || fail "$name: the last agent did not stop cleanly"
    stop_server "$spid" 15 || fail "$name: serve-image did not stop cleanly"
}

IFS=, read -r -a peer_list <<<"$peers"
for peer in "${peer_list[@]}"; do
    log "peer $peer: one guest, $hops live migrations, vdstest.secs=$secs"
    case $peer in
    trace) case_trace ;;
    vdstream) case_vdstream vdstream 0.5 ;;
    vdstream-quiet) case_vdstream vdstream-quiet 3 ;;
    vdstream-busy) case_vdstream vdstream-busy 0 ;;
    vdstream-tls) VDS_LINK=tls case_vdstream vdstream-tls 0.5 ;;
    *) case_shared "$peer" ;;
    esac
done

echo
echo "\`bench/migrate.sh ${args_given}\` — $(date -u +%Y-%m-%dT%H:%MZ), $(nproc) CPUs, -accel $accel, $(qemu-system-x86_64 --version | head -n1), guest -m 192M, vdstest.secs=$secs"
echo
"$PY" - "$RESULTS" <<'PYEOF'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("| peer | hop | route | downtime ms | total ms | setup ms | RAM sent MiB |")
print("| --- | ---: | --- | ---: | ---: | ---: | ---: |")
for r in rows:
    print(f"| {r['peer']} | {r['hop']} | {r['route']} | {r['downtime']} | {r['total-time']} | {r['setup-time']} | "
          f"{r['ram-transferred'] / 2**20:.1f} |")
print()
print("| peer | migrations | median downtime ms | median total ms | downtime min–max ms |")
print("| --- | ---: | ---: | ---: | --- |")
for p in dict.fromkeys(r["peer"] for r in rows):
    d = [r["downtime"] for r in rows if r["peer"] == p]
    t = [r["total-time"] for r in rows if r["peer"] == p]
    print(f"| {p} | {len(d)} | {statistics.median(d):g} | {statistics.median(t):g} | {min(d)}–{max(d)} |")
vds = [r for r in rows if "held" in r]
if vds:
    print()
    print("The handover (vdstream rows): the cache held beyond the vDisk at the switch, what moved, on the wire")
    print()
    print("| peer | hop | rounds | cache held KiB | moved KiB | wire KiB | wire / held | final delta KiB | fenced ms |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in vds:
        ratio = r["wire"] / r["held"] if r["held"] else 0
        print(f"| {r['peer']} | {r['hop']} | {r['rounds']} | {r['held'] >> 10} | {r['moved'] >> 10} | {r['wire'] >> 10} | "
              f"{ratio:.2f} | {r['final'] >> 10} | {r['fenced_ms']} |")
PYEOF
echo
echo "Every guest ended with VDSTEST DONE status=ok and KERNEL-IO-ERRORS n=0; e2fsck -fn clean."
if [[ -f $E2E_TMP/trace.report ]]; then
    echo
    echo "trace (nbdkit log filter, one instance per side; downtime includes the pause at pre-switchover):"
    cat "$E2E_TMP/trace.report"
fi
