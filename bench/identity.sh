#!/usr/bin/env bash
# bench/identity.sh — what proving a machine's TPM identity adds to an attach, beside
# today's anonymous attach in the same run (docs/IDENTITY.md). One store server with
# --identity-ca, NBD TLS offered (--tls on) and anonymous clients allowed (--anonymous
# all), the API over HTTPS; each machine has its own swtpm and an approved key.
# - one machine, --rounds times each way: the time from `target attach` to its disk
#   answering NBD, anonymous (plain NBD) and with `--tpm` (the proof: two TPM keys, the
#   credential activation, a signature, a certificate, then NBD over TLS with it);
# - a storm: --machines machines attach at once, each way: the time until every disk
#   answers.
# The TPM is swtpm (software): a hardware TPM's ECC operations take longer (tens of ms
# each), so the proof's share on real machines is larger than here.
#
# Usage: bench/identity.sh [--machines 8] [--rounds 5]
# Environment: VDSTREAM_BIN (default target/release/vdstream), VDSTREAM_E2E_KEEP=1, TMPDIR.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$ROOT/bench/lib.sh"
machines=8 rounds=5
args_given="$*"
while (($#)); do
    case $1 in
    --machines) machines=$2; shift ;;
    --rounds) rounds=$2; shift ;;
    -h | --help) bench_help ;;
    *) bench_bad_arg "$1" ;;
    esac
    shift
done
need_vdstream
need_cmds nbdinfo swtpm

# shellcheck source=../tests/e2e/lib.sh
source "$ROOT/tests/e2e/lib.sh"
# shellcheck source=../tests/e2e/store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=../tests/e2e/agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
# shellcheck source=../tests/e2e/identity-lib.sh
source "$E2E_DIR/identity-lib.sh"
e2e_init
store_init
echo "# bench/identity.sh $args_given"
echo "# $(date -u +%FT%TZ), $(nproc) cores, $machines machines, swtpm $(swtpm --version 2>&1 | grep -Eo '[0-9]+\.[0-9]+\.[0-9]+' | head -n1)"

head -c $((8 << 20)) /dev/urandom >"$E2E_TMP/boot.img"
vds vdisk import boot "$E2E_TMP/boot.img" >/dev/null
for ((i = 0; i < machines; i++)); do
    # A MAC: a booting machine without a credential may read only records that name one.
    vds target add "m$i" --vdisk boot --cache device-ram --ram 16M --mac "$(printf '52:54:00:00:10:%02x' "$i")" >/dev/null
done
identity_pki
# --boot: what a network-booted machine without a credential may read of the API (its record,
# the servers), the anonymous machine's way in.
identity_server --tls on --anonymous all --boot
agent_env
mkdir -p "$VDSTREAM_RUN_DIR"

# ready ID PID — waits (bounded) until machine ID's disk answers NBD.
ready() {
    local sock=$VDSTREAM_RUN_DIR/$1.sock i
    for ((i = 0; i < 3000; i++)); do
        [[ -S $sock ]] && nbdinfo --size "nbd+unix:///?socket=$sock" >/dev/null 2>&1 && return 0
        kill -0 "$2" 2>/dev/null || fail "machine $1's agent exited: $(tail -n 3 "$E2E_TMP"/boot-"$1"-*.log "$E2E_TMP/anon-$1.log" 2>/dev/null)"
        sleep 0.01
    done
    fail "machine $1's disk did not answer within 30 s"
}
# attach MODE ID — starts machine ID's attach (anonymous, or with its TPM); sets ATTACH_PID.
attach() {
    if [[ $1 == tpm ]]; then
        local v=TPM_m$2
        identity_boot "m$2" "${!v}" --identity-wait 30s
        ATTACH_PID=$BOOT_PID
    else
        VDSTREAM_TLS_CERTIFICATES=$ID_CA_ONLY "$VDSTREAM_BIN" target attach "m$2" --server "$ID_API" \
            >"$E2E_TMP/anon-m$2.log" 2>&1 </dev/null &
        ATTACH_PID=$!
        track_pid "$ATTACH_PID"
    fi
}
now() { date +%s.%N; }

# Every machine's TPM, and its key enrolled and approved (a first proof, then approval).
for ((i = 0; i < machines; i++)); do
    tpm_start "m$i"
    v=TPM_m$i
    identity_boot "m$i" "${!v}" --identity-wait 30s
    pids[i]=$BOOT_PID
done
for ((i = 0; i < machines; i++)); do
    for ((t = 0; t < 300; t++)); do
        fp=$(grep -Eo 'sha256:[0-9a-f]{64}' "$E2E_TMP/boot-m$i-$((i + 1)).log" 2>/dev/null | head -n1 || true)
        [[ -n $fp ]] && break
        sleep 0.1
    done
    [[ -n $fp ]] || fail "machine m$i did not prove a key"
    vds target identity approve "m$i" --fingerprint "$fp" >/dev/null
done
for ((i = 0; i < machines; i++)); do
    ready "m$i" "${pids[i]}"
    stop_pid "${pids[i]}" 10
done

printf '%-10s %-6s %10s\n' mode round seconds
declare -A one
storm=()
for ((r = 1; r <= rounds; r++)); do
    for mode in anonymous tpm; do
        t0=$(now)
        attach "$mode" 0
        ready m0 "$ATTACH_PID"
        t1=$(now)
        stop_pid "$ATTACH_PID" 10
        s=$("$PY" -c "print(f'{$t1 - $t0:.3f}')")
        one[$mode]+="$s "
        printf '%-10s %-6s %10s\n' "$mode" "$r" "$s"
    done
done
for mode in anonymous tpm; do
    t0=$(now)
    for ((i = 0; i < machines; i++)); do
        attach "$mode" "$i"
        spids[i]=$ATTACH_PID
    done
    for ((i = 0; i < machines; i++)); do ready "m$i" "${spids[i]}"; done
    t1=$(now)
    for ((i = 0; i < machines; i++)); do stop_pid "${spids[i]}" 10; done
    storm+=("$("$PY" -c "print(f'{$t1 - $t0:.3f}')")")
    printf '%-10s %-6s %10s\n' "$mode" storm "${storm[-1]}"
done
"$PY" - "${one[anonymous]}" "${one[tpm]}" "${storm[0]}" "${storm[1]}" "$machines" <<'PYEOF'
import statistics, sys
anon = [float(x) for x in sys.argv[1].split()]
tpm = [float(x) for x in sys.argv[2].split()]
sa, st, n = float(sys.argv[3]), float(sys.argv[4]), sys.argv[5]
ma, mt = statistics.median(anon), statistics.median(tpm)
print(f"one machine, median to its disk: anonymous {ma:.2f} s, with the TPM proof {mt:.2f} s: +{mt - ma:.2f} s ({mt / ma:.2f}x)")
print(f"{n} machines at once, until every disk answers: anonymous {sa:.2f} s, with the TPM proof {st:.2f} s ({st / sa:.2f}x)")
PYEOF
grep -c "proved key" "$SERVER_LOG" | sed 's/^/proofs logged by the server: /'
