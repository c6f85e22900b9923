#!/usr/bin/env bash
# bench/boot-storm.sh — real Linux guests (the golden image of scripts/make-golden-image,
# under qemu) booting and working from a streamed vDisk. Three measurements, each against
# a peer in the same run:
#
#   boot       one guest boots (vdstest=boot: kernel, initramfs, init, power-off) from a
#              local raw copy of the image (the peer) and through `vdstream server` plus a
#              `ram-overflow` agent, alternately, --boots times each: wall seconds.
#   storm      --targets guests boot at once from one vDisk through one server, each with
#              its own ram-overflow agent, writing 1 MiB with sync: each boot time, guest
#              reads against store reads, failures; once with the shared read cache
#              (--read-cache 256M) and once without (--read-cache 0, the peer).
#   workload   one guest per cache type runs the guest workload (vdstest=workload: tar copy
#              of /usr/lib/modules, 200 small files with a sync every 20, a log, remove,
#              sync; --rounds rounds) through its own ext4 and journal; the agent's status
#              gives guest writes against storage writes: device-disk (the peer),
#              ram-overflow --ram 256M, ram-overflow --ram 16M.
#
# Usage: bench/boot-storm.sh [--targets 16] [--boots 3] [--rounds 3]
#                            [--only boot|storm|workload] [--agent-arg ARG]...
#   --agent-arg ARG   passed to the workload's agents (`vdstream target attach`), e.g. to
#                     record the guest workload's I/O; repeat for several arguments
# Environment: VDSTREAM_BIN, VDSTREAM_VM_ACCEL (tcg|kvm; default: probed), TMPDIR.
# Guests run with -accel tcg unless KVM boots a guest (tests/e2e/vm-lib.sh).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"
targets=16 boots=3 rounds=3 only= agent_args=()
args_given="$*"
while (($#)); do
    case $1 in
    --targets) targets=$2; shift ;;
    --boots) boots=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    --only) only=$2; shift ;;
    --agent-arg) agent_args+=("$2"); shift ;;
    -h | --help) bench_help ;;
    *) bench_bad_arg "$1" ;;
    esac
    shift
done

# The end-to-end helpers start the store, server, agents and guests and stop them on exit.
# shellcheck source=../tests/e2e/lib.sh
source "$ROOT/tests/e2e/lib.sh"
# shellcheck source=../tests/e2e/store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=../tests/e2e/server-lib.sh
source "$E2E_DIR/server-lib.sh"
# shellcheck source=../tests/e2e/agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
# shellcheck source=../tests/e2e/vm-lib.sh
source "$E2E_DIR/vm-lib.sh"
VM_SECS=${VDSTREAM_VM_SECS:-600} # a guest's bound: storms and workloads take longer than a test's boot
vm_test_init golden
echo "# bench/boot-storm.sh $args_given"
echo "# $(date -u +%FT%TZ), $(nproc) cores, -accel $(vm_accel), guest kernel $(file -b "$GOLDEN/vmlinuz" | grep -o 'version [^ ]*' || echo '?')"
want() { [[ -z $only || $only == "$1" ]]; }

# median FILE — the median of the numbers in FILE, one a line.
median() { sort -n "$1" | awk '{ v[NR] = $1 } END { printf "%.1f", (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

# ---------------------------------------------------------------- boot
if want boot; then
    start_store_server
    : >"$E2E_TMP/boot-local.secs"
    : >"$E2E_TMP/boot-agent.secs"
    for ((b = 1; b <= boots; b++)); do
        cp --sparse=always "$GOLDEN/golden.img" "$E2E_TMP/local.img"
        boot_vm "local$b" "$E2E_TMP/local.img" vdstest=boot
        vm_secs "local$b" >>"$E2E_TMP/boot-local.secs"; echo >>"$E2E_TMP/boot-local.secs"
        start_agent "boot$b" --server "$(xuri vdisk/golden)" --cache ram-overflow
        boot_vm "boot$b" "$URI" vdstest=boot
        vm_secs "boot$b" >>"$E2E_TMP/boot-agent.secs"; echo >>"$E2E_TMP/boot-agent.secs"
        stop_server "$AGENT_PID" 15 || fail "agent boot$b did not stop cleanly"
    done
    rm -f "$E2E_TMP/local.img"
    l=$(median "$E2E_TMP/boot-local.secs") a=$(median "$E2E_TMP/boot-agent.secs")
    echo
    echo "## boot: one guest, $boots boots each (wall seconds, qemu start to power-off)"
    echo "local raw file: $(paste -sd' ' "$E2E_TMP/boot-local.secs") (median $l s)"
    echo "server + ram-overflow agent: $(paste -sd' ' "$E2E_TMP/boot-agent.secs") (median $a s)"
    awk -v l="$l" -v a="$a" 'BEGIN { printf "streamed / local: %.2fx the boot time\n", a / l }'
    stop_server "$SERVER_PID" 15 || fail "the server did not stop cleanly"
fi

# ---------------------------------------------------------------- storm
# storm PREFIX READ_CACHE — one storm of $targets guests; prints its report.
storm() {
    local prefix=$1 rc=$2 api start
    start_store_server --http 127.0.0.1:0 --read-cache "$rc"
    api=$(grep -Eo 'http://127\.0\.0\.1:[0-9]+' "$SERVER_LOG" | head -n1)
    start=$SECONDS
    vm_storm "$targets" "$prefix" "$(xuri vdisk/golden)" "vdstest=write vdstest.mb=1" \
        --cache ram-overflow --ram 32M >"$E2E_TMP/$prefix.table"
    local wall=$((SECONDS - start))
    curl -sS --max-time 10 "$api/api/v1/server" >"$E2E_TMP/$prefix.server.json" || fail "GET /api/v1/server failed"
    echo
    echo "## storm: $targets guests at once, server --read-cache $rc ($wall s from the first agent's start to the last power-off)"
    cat "$E2E_TMP/$prefix.table"
    "$PY" - "$E2E_TMP/$prefix.server.json" "$E2E_TMP/$prefix.storm.jsonl" <<'PYEOF'
import json, sys
srv = json.load(open(sys.argv[1]))
rows = [json.loads(l) for l in open(sys.argv[2])]
secs = sorted(r["secs"] for r in rows)
n = len(rows)
guest = sum(r["guest"]["read_bytes"] for r in rows)
agents = sum(r["from_server_bytes"] for r in rows)
one = max(r["from_server_bytes"] for r in rows)
store = srv["io"]["store"]["read_bytes"]
print(f"boot s: min {secs[0]:.1f}, median {secs[n // 2]:.1f}, max {secs[-1]:.1f}; failures: 0 of {n}")
print(f"guest reads {guest >> 10} KiB; agents' reads from the server {agents >> 10} KiB; "
      f"store reads {store >> 10} KiB = {store / one:.2f}x one target's, {store / agents:.3f} of the agents' reads")
PYEOF
    stop_server "$SERVER_PID" 15 || fail "the server did not stop cleanly"
}
if want storm; then
    storm storm-cache 256M
    storm storm-nocache 0
fi

# ---------------------------------------------------------------- workload
# workload ID CACHE ARGS... — the guest workload on target ID; one JSON line of its I/O.
workload() {
    local id=$1 cache=$2
    shift 2
    start_agent "$id" --server "$(xuri vdisk/golden)" --cache "$cache" "$@" "${agent_args[@]}"
    boot_vm "$id" "$URI" "vdstest=workload vdstest.rounds=$rounds"
    sleep 1.5 # the agent rewrites its status file every second
    "$VDSTREAM_BIN" target status "$id" --json >"$E2E_TMP/$id.status.json"
    stop_server "$AGENT_PID" 15 || fail "agent $id did not stop cleanly"
    "$PY" - "$E2E_TMP/$id.status.json" "$id" "$cache $*" "$(vm_secs "$id")" <<'PYEOF'
import json, sys
j = json.load(open(sys.argv[1]))
g, s = j["guest"], j["storage"]
print(f"| {sys.argv[3]:<28} | {g['write_ops']:>9} | {g['write_bytes'] >> 20:>9} | {s['write_ops']:>11} | "
      f"{s['write_bytes'] >> 20:>11} | {s['write_ops'] / max(g['write_ops'], 1):>9.3f} | "
      f"{s['write_bytes'] / max(g['write_bytes'], 1):>9.3f} | {float(sys.argv[4]):>6.1f} |")
PYEOF
}
if want workload; then
    start_store_server
    echo
    echo "## workload: vdstest=workload, $rounds rounds, one guest per cache type"
    echo "| cache                        | guest wr ops | guest MiB | storage wr ops | storage MiB | ops ratio | MiB ratio | secs |"
    echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
    workload wl-disk device-disk
    workload wl-ram256 ram-overflow --ram 256M
    workload wl-ram16 ram-overflow --ram 16M
    stop_server "$SERVER_PID" 15 || fail "the server did not stop cleanly"
fi
