#!/usr/bin/env bash
# Live migration of a target's write cache between two agents, each on its own "host" (its
# own run and cache folders), for every host-side cache type: ram-overflow with most of
# its cache in overflow, device-ram, device-disk, device-disk-persistent. qemu-io writes
# (data and write-zeroes) to the source while the destination copies; then
# `vdstream target migrate` switches, the source ends with state "migrated", and the
# destination's disk equals a file that took the same writes. Then back (B to A) with
# writes meanwhile; a cancelled migration and a destination killed with SIGKILL mid-copy
# leave the source serving, its data whole. A destination on another vDisk or cache type is
# refused with a message naming both. Then the link between hosts: TCP with TLS, where only the
# target's own certificate links (MIGRATE_TYPES="..." runs some cache types only). Last, the
# server types, whose cache the store server keeps: the handover moves their attach (the
# destination joins it, the source is fenced and flushes), A to B to A and a cancel, on one
# attach throughout.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=server-lib.sh
source "$E2E_DIR/server-lib.sh"
require qemu-io nbdinfo nbdcopy cmp
require_vdstream
e2e_init

size=$((48 << 20))
base=$E2E_TMP/base.img
head -c "$size" /dev/urandom >"$base"
start_server "$base" --read-only --name golden
srv_uri=$URI

# on HOST CMD... — CMD with HOST's run and cache folders (two agents of one target, as on
# two hosts).
on() {
    local host=$1; shift
    VDSTREAM_RUN_DIR=$E2E_TMP/$host/run VDSTREAM_CACHE_DIR=$E2E_TMP/$host/cache "$@"
}

# attach_on HOST ID ARGS... — the target's agent on HOST, waited for (bounded); sets PID_<HOST>.
attach_on() {
    local host=$1 id=$2; shift 2
    mkdir -p "$E2E_TMP/$host"
    # Not through `on`: the pid must be the agent's own, for kill -KILL.
    VDSTREAM_RUN_DIR=$E2E_TMP/$host/run VDSTREAM_CACHE_DIR=$E2E_TMP/$host/cache \
        "$VDSTREAM_BIN" target attach "$id" --server "$srv_uri" "$@" \
        >"$E2E_TMP/agent-$host-$id.log" 2>&1 </dev/null &
    local pid=$!
    E2E_PIDS+=("$pid")
    E2E_SERVER_LOGS+=("$E2E_TMP/agent-$host-$id.log")
    printf -v "PID_$host" '%s' "$pid"
    wait_ready "$pid" "nbd+unix:///?socket=$E2E_TMP/$host/run/$id.sock"
}

sock_of() { echo "nbd+unix:///?socket=$E2E_TMP/$1/run/$2.sock"; }

# write_both URI CMD — one qemu-io write on the agent's export and on the model file.
write_both() {
    run_bounded 60 qemu-io -f raw -c "$2" "$1" >/dev/null || fail "qemu-io $2 on $1"
    run_bounded 60 qemu-io -f raw -c "$2" "$model" >/dev/null || fail "qemu-io $2 on the model"
}

# phase HOST ID — the agent's migration phase ("" without one).
phase() {
    on "$1" "$VDSTREAM_BIN" target status "$2" --json 2>/dev/null >"$E2E_TMP/st.json" || true
    json_get "$E2E_TMP/st.json" '(j.get("migration") or {}).get("phase", "")' 2>/dev/null || true
}

wait_phase() {
    local host=$1 id=$2 want=$3 i
    for ((i = 0; i < 300; i++)); do
        [[ $(phase "$host" "$id") == "$want" ]] && return 0
        sleep 0.1
    done
    fail "$id on $host: migration phase $(phase "$host" "$id"), not $want, after 30 s"
}

# same_disk URI — the export reads as the model, byte for byte.
same_disk() {
    rm -f "$E2E_TMP/read.img"
    run_bounded 60 nbdcopy "$1" "$E2E_TMP/read.img" || fail "nbdcopy $1"
    cmp "$E2E_TMP/read.img" "$model" || fail "$2: the disk differs from the model"
}

# migrate HOST ID — `target migrate` on HOST (no qemu here: it switches once converged).
migrate() {
    on "$1" "$VDSTREAM_BIN" target migrate "$2" --json >"$E2E_TMP/migrate.json" 2>"$E2E_TMP/migrate.err" ||
        fail "target migrate $2 on $1: $(cat "$E2E_TMP/migrate.err")"
    json_get "$E2E_TMP/migrate.json" 'j["handover"]["phase"]' | grep -qx done || fail "not done: $(cat "$E2E_TMP/migrate.json")"
}

wait_gone() {
    local pid=$1 what=$2 i rc=0
    for ((i = 0; i < 100; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -0 "$pid" 2>/dev/null && fail "$what did not end"
    wait "$pid" || rc=$?
    echo "$rc"
}

for type in ${MIGRATE_TYPES:-ram-overflow device-ram device-disk device-disk-persistent}; do
    log "==== $type ===="
    id=m-$type
    args=(--cache "$type")
    [[ $type == ram-overflow ]] && args+=(--ram 4M)
    [[ $type == device-ram ]] && args+=(--ram 64M)
    rm -rf "$E2E_TMP/a" "$E2E_TMP/b"
    model=$E2E_TMP/model.img
    cp "$base" "$model"
    attach_on a "$id" "${args[@]}"
    pid_a=$PID_a
    write_both "$(sock_of a "$id")" "write -P 0x11 0 8M"
    write_both "$(sock_of a "$id")" "write -z 1M 1M"
    write_both "$(sock_of a "$id")" "write -P 0x22 30000001 70000"

    # A to B, with writes while B copies.
    attach_on b "$id" "${args[@]}" --incoming "$E2E_TMP/a/run/$id.migrate"
    pid_b=$PID_b
    for i in $(seq 1 12); do
        write_both "$(sock_of a "$id")" "write -P $((i + 40)) $((i * 512 * 1024 + 12 * 1024 * 1024)) 300k"
    done
    wait_phase b "$id" converged
    migrate a "$id"
    assert_eq "$type: source exit status after the handover" "$(wait_gone "$pid_a" "the source agent")" 0
    assert_eq "$type: the source's last state" "$(phase a "$id")" done
    json_get "$E2E_TMP/st.json" 'j["state"]' | grep -qx migrated || fail "$type: the source's state is not migrated"
    if [[ $type == device-disk-persistent ]]; then
        [[ -z $(ls "$E2E_TMP/a/cache/$id" 2>/dev/null) ]] || fail "$type: the source left its cache files: $(ls "$E2E_TMP/a/cache/$id")"
    fi
    same_disk "$(sock_of b "$id")" "$type A to B"
    log "ok: $type: A to B moved the cache: $(json_get "$E2E_TMP/migrate.json" 'j["handover"]')"

    # B to A, with writes on B first.
    write_both "$(sock_of b "$id")" "write -P 0x33 20M 2M"
    attach_on a "$id" "${args[@]}" --incoming "$E2E_TMP/b/run/$id.migrate"
    pid_a=$PID_a
    write_both "$(sock_of b "$id")" "write -P 0x44 21M 64k"
    wait_phase a "$id" converged
    migrate b "$id"
    assert_eq "$type: B exit status after the handover" "$(wait_gone "$pid_b" "agent B")" 0
    same_disk "$(sock_of a "$id")" "$type B to A"

    # A cancelled migration: the destination ends, the source serves on.
    attach_on b "$id" "${args[@]}" --incoming "$E2E_TMP/a/run/$id.migrate"
    pid_b=$PID_b
    wait_phase b "$id" converged
    on a "$VDSTREAM_BIN" target migrate "$id" --cancel >/dev/null || fail "$type: --cancel failed"
    rc=$(wait_gone "$pid_b" "the cancelled destination")
    ((rc != 0)) || fail "$type: a cancelled destination exited 0"
    grep -q "the incoming migration failed" "$E2E_TMP/agent-b-$id.log" || fail "$type: the destination did not say why it ended"
    wait_phase a "$id" cancelled
    write_both "$(sock_of a "$id")" "write -P 0x55 5M 64k"

    # A destination killed mid-copy: the source serves on.
    attach_on b "$id" "${args[@]}" --incoming "$E2E_TMP/a/run/$id.migrate"
    kill -KILL "$PID_b"
    wait "$PID_b" 2>/dev/null || true
    wait_phase a "$id" failed
    write_both "$(sock_of a "$id")" "write -P 0x66 6M 64k"
    same_disk "$(sock_of a "$id")" "$type after a cancel and a killed destination"
    rc=0
    stop_server "$pid_a" 15 || rc=$?
    assert_eq "$type: source exit status" "$rc" 0
    log "ok: $type: A to B to A, a cancel and a killed destination: every byte where it belongs"
done

# A destination that does not match is refused, naming both sides.
attach_on a m-check --cache device-ram --ram 64M
VDSTREAM_RUN_DIR=$E2E_TMP/b/run VDSTREAM_CACHE_DIR=$E2E_TMP/b/cache \
    "$VDSTREAM_BIN" target attach m-check --server "$srv_uri" --cache ram-overflow --incoming "$E2E_TMP/a/run/m-check.migrate" >"$E2E_TMP/wrong.log" 2>&1 </dev/null &
pid_b=$!
E2E_PIDS+=("$pid_b")
rc=$(wait_gone "$pid_b" "a mismatched destination")
((rc != 0)) || fail "a destination with another cache type exited 0"
grep -q "ram-overflow cache, this agent device-ram: use --cache device-ram" "$E2E_TMP/wrong.log" ||
    fail "the refusal does not name both cache types: $(tail -n 3 "$E2E_TMP/wrong.log")"
rc=0
out=$(on a "$VDSTREAM_BIN" target migrate m-check --converge-for 1s 2>&1) || rc=$?
assert_eq "migrate without a destination: exit status (4: conflict)" "$rc" 4
grep -q "no destination agent converged" <<<"$out" || fail "migrate without a destination: $out"
log "ok: a mismatched destination is refused; migrate without one says what to start"

# Between hosts: TCP with TLS, both agents showing the target's own certificate. Another
# target's certificate, or none, is refused at the handshake and logged; the handover over
# TLS moves every byte.
log "==== the TLS link ===="
export VDSTREAM_CA=$E2E_TMP/ca
"$VDSTREAM_BIN" pki init --farm lab >/dev/null || fail "pki init"
for who in "m-tls a" "m-tls b" "other x"; do
    read -r t dir <<<"$who"
    "$VDSTREAM_BIN" pki issue target "$t" --out "$E2E_TMP/tls-$dir" >/dev/null || fail "pki issue target $t"
done
rm -rf "$E2E_TMP/a" "$E2E_TMP/b"
model=$E2E_TMP/model.img
cp "$base" "$model"
args=(--cache device-disk)
attach_on a m-tls "${args[@]}" --migrate-listen 127.0.0.1:0 --migrate-certificates "$E2E_TMP/tls-a"
pid_a=$PID_a
addr=$(grep -o 'tls://127\.0\.0\.1:[0-9]*' "$E2E_TMP/agent-a-m-tls.log" | head -n 1)
[[ -n $addr ]] || fail "the source does not say where it listens: $(tail -n 3 "$E2E_TMP/agent-a-m-tls.log")"
write_both "$(sock_of a m-tls)" "write -P 0x71 0 6M"

rc=0
out=$(on x "$VDSTREAM_BIN" target attach m-tls --server "$srv_uri" "${args[@]}" --incoming "$addr" --migrate-certificates "$E2E_TMP/tls-x" 2>&1) || rc=$?
assert_eq "a destination started with another target's certificate: exit status (2: usage)" "$rc" 2
grep -q "names target:other; the migration link needs target:m-tls's certificate" <<<"$out" || fail "the refusal at start: $out"
hostport=${addr#tls://}
openssl s_client -connect "$hostport" -cert "$E2E_TMP/tls-x/client-cert.pem" -key "$E2E_TMP/tls-x/client-key.pem" \
    -CAfile "$E2E_TMP/tls-x/ca-cert.pem" </dev/null >"$E2E_TMP/s_client.log" 2>&1 || true
openssl s_client -connect "$hostport" -CAfile "$E2E_TMP/tls-x/ca-cert.pem" </dev/null >>"$E2E_TMP/s_client.log" 2>&1 || true
for ((i = 0; i < 50; i++)); do
    (($(grep -c "refused a migration link from tls://127.0.0.1" "$E2E_TMP/agent-a-m-tls.log") >= 2)) && break
    sleep 0.1
done
grep -q "refused a migration link from tls://127.0.0.1:[0-9]*: .*names target:other, not target:m-tls" "$E2E_TMP/agent-a-m-tls.log" ||
    fail "another target's certificate was not refused and logged: $(grep migration "$E2E_TMP/agent-a-m-tls.log" | tail -n 3)"
(($(grep -c "refused a migration link from tls://127.0.0.1" "$E2E_TMP/agent-a-m-tls.log") >= 2)) ||
    fail "a client without a certificate was not refused: $(grep migration "$E2E_TMP/agent-a-m-tls.log" | tail -n 3)"
[[ -z $(phase a m-tls) ]] || fail "a refused link began a migration: $(phase a m-tls)"

attach_on b m-tls "${args[@]}" --incoming "$addr" --migrate-certificates "$E2E_TMP/tls-b"
pid_b=$PID_b
for i in 1 2 3 4; do
    write_both "$(sock_of a m-tls)" "write -P $((i + 0x72)) $((i * 3))M 1M"
done
wait_phase b m-tls converged
json_get "$E2E_TMP/st.json" '(j.get("migration") or {}).get("peer", "")' | grep -q "$addr" ||
    fail "the destination's status does not name its source: $(cat "$E2E_TMP/st.json")"
migrate a m-tls
assert_eq "TLS: source exit status after the handover" "$(wait_gone "$pid_a" "the source agent")" 0
same_disk "$(sock_of b m-tls)" "A to B over TLS"
rc=0
stop_server "$pid_b" 15 || rc=$?
assert_eq "TLS: destination exit status" "$rc" 0
log "ok: over TLS only the target's own certificate links; the handover moved every byte"

# The server types: the store server keeps the cache, the attach moves.
log "==== server, server-persistent: the attach moves ===="
store_init
golden_vdisk w 16
for type in server server-persistent; do
    vds target add "m-$type" --vdisk w --cache "$type" >/dev/null
done
start_store_server
for type in server server-persistent; do
    id=m-$type
    srv_uri=$(xuri "target/$id" "$SOCK")
    rm -rf "$E2E_TMP/a" "$E2E_TMP/b"
    attach_on a "$id" --cache "$type"
    pid_a=$PID_a
    model=$E2E_TMP/model.img
    rm -f "$model"
    run_bounded 60 nbdcopy "$(sock_of a "$id")" "$model" || fail "$type: nbdcopy"
    write_both "$(sock_of a "$id")" "write -P 0x11 0 2M"

    attach_on b "$id" --cache "$type" --incoming "$E2E_TMP/a/run/$id.migrate"
    pid_b=$PID_b
    grep -q "joining attach target/$id@" "$E2E_TMP/agent-b-$id.log" || fail "$type: the destination did not join the source's attach"
    write_both "$(sock_of a "$id")" "write -P 0x12 4M 1M"
    wait_phase b "$id" converged
    migrate a "$id"
    assert_eq "$type: source exit status after the handover" "$(wait_gone "$pid_a" "the source agent")" 0
    same_disk "$(sock_of b "$id")" "$type A to B"

    write_both "$(sock_of b "$id")" "write -P 0x13 6M 1M"
    attach_on a "$id" --cache "$type" --incoming "$E2E_TMP/b/run/$id.migrate"
    pid_a=$PID_a
    wait_phase a "$id" converged
    migrate b "$id"
    assert_eq "$type: B exit status after the handover" "$(wait_gone "$pid_b" "agent B")" 0
    same_disk "$(sock_of a "$id")" "$type B to A"

    attach_on b "$id" --cache "$type" --incoming "$E2E_TMP/a/run/$id.migrate"
    pid_b=$PID_b
    wait_phase b "$id" converged
    on a "$VDSTREAM_BIN" target migrate "$id" --cancel >/dev/null || fail "$type: --cancel failed"
    rc=$(wait_gone "$pid_b" "the cancelled destination")
    ((rc != 0)) || fail "$type: a cancelled destination exited 0"
    write_both "$(sock_of a "$id")" "write -P 0x14 8M 64k"
    same_disk "$(sock_of a "$id")" "$type after a cancel"
    assert_eq "$type: attaches the store server made" "$(grep -c "target $id: new attach" "$SERVER_LOG")" 1
    rc=0
    stop_server "$pid_a" 15 || rc=$?
    assert_eq "$type: last agent exit status" "$rc" 0
    log "ok: $type: A to B to A and a cancel moved the attach, one attach throughout, every byte where it belongs"
done
