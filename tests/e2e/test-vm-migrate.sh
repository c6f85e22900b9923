#!/usr/bin/env bash
# A running guest migrates live between two hosts' agents (two run and cache folders),
# its disk on each agent's NBD socket, its write cache moved with it: A to B to A to B to A,
# driven by `vdstream target migrate ID --qmp SOCKET --to URI` on the source "host". The
# guest writes and verifies all along (vdstest=loop vdstest.keep=1: files written, synced,
# read back past the page cache, and all of them checked again at the end), and must end
# with every round ok, every file verified and no kernel I/O error; then the disk its last
# agent serves passes e2fsck. One run per TYPE:TRANSPORT in MIGRATE_CASES: by default every
# host-side cache type, two through the agents' NBD sockets and two as vhost-user-blk
# devices (whose backend logs the guest pages it dirties, or qemu would refuse to migrate):
# ram-overflow (2 MiB of RAM: most of its cache in overflow when it moves) and device-disk-persistent
# over NBD, device-ram and device-disk over vhost-user-blk, the last between agents linked by
# TCP with TLS (TYPE:TRANSPORT:tls; both show the target's certificate, as on two hosts);
# the others over the source's migration socket. The server types (server over NBD,
# server-persistent over vhost-user-blk), whose cache the store server keeps, move their
# attach: the destination joins it. test-agent-migrate covers every
# type without a guest, with a cancel and a killed destination. Prints qemu's downtime and
# the handover's figures for each migration.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=server-lib.sh
source "$E2E_DIR/server-lib.sh"
# shellcheck source=vm-lib.sh
source "$E2E_DIR/vm-lib.sh"
# shellcheck source=migrate-lib.sh
source "$E2E_DIR/migrate-lib.sh"
require e2fsck qemu-img
vm_test_init golden
start_store_server

HOPS=${MIGRATE_HOPS:-4}
read -r -a cases <<<"${MIGRATE_CASES:-ram-overflow:nbd device-disk-persistent:nbd device-ram:vhost device-disk:vhost:tls server:nbd server-persistent:vhost}"

# attach_on HOST ID ARGS... — the target's agent on HOST (its own run and cache folders).
attach_on() {
    local host=$1 id=$2 run=$E2E_TMP/$1/run; shift 2
    mkdir -p "$E2E_TMP/$host"
    # vhost-user-blk with the NBD socket beside it: the test reads the disk through that.
    [[ $transport == vhost ]] && set -- "$@" --vhost-user "$run/$id.vhost" --vhost-queues 1 --socket "$run/$id.sock"
    [[ $link == tls ]] && set -- "$@" --migrate-listen 127.0.0.1:0 --migrate-certificates "$E2E_TMP/tls-$host"
    # The server types read their target's export (the store server keeps their cache).
    local export=vdisk/golden
    [[ $type == server* ]] && export=target/$id
    VDSTREAM_RUN_DIR=$E2E_TMP/$host/run VDSTREAM_CACHE_DIR=$E2E_TMP/$host/cache \
        "$VDSTREAM_BIN" target attach "$id" --server "$(xuri "$export")" "$@" \
        >>"$E2E_TMP/agent-$host-$id.log" 2>&1 </dev/null &
    AGENT_PID=$!
    track_pid "$AGENT_PID"
    E2E_SERVER_LOGS+=("$E2E_TMP/agent-$host-$id.log")
    wait_ready "$AGENT_PID" "nbd+unix:///?socket=$E2E_TMP/$host/run/$id.sock"
}
# drive_on HOST ID — the disk of the guest on HOST, through the transport of this case.
drive_on() {
    if [[ $transport == vhost ]]; then
        echo "vhost:$E2E_TMP/$1/run/$2.vhost"
    else
        echo "file=nbd+unix:///?socket=$E2E_TMP/$1/run/$2.sock,format=raw,if=virtio"
    fi
}

# source_of HOST ID — where a destination reaches the source agent on HOST: its migration
# socket, or with the TLS link the address its listener says it took.
source_of() {
    if [[ $link == tls ]]; then
        grep -o 'live migrations from this agent: .* and tls://127\.0\.0\.1:[0-9]*' "$E2E_TMP/agent-$1-$2.log" |
            tail -n 1 | grep -o 'tls://.*' || fail "the agent on $1 does not say where it listens"
    else
        echo "$E2E_TMP/$1/run/$2.migrate"
    fi
}

for case in "${cases[@]}"; do
    IFS=: read -r type transport link <<<"$case"
    id=mig-$type
    [[ $type == server* ]] && { vds target add "$id" --vdisk golden --cache "$type" >/dev/null || fail "target add $id"; }
    if [[ $link == tls ]]; then
        export VDSTREAM_CA=$E2E_TMP/ca
        [[ -e $VDSTREAM_CA/ca-cert.pem ]] || "$VDSTREAM_BIN" pki init --farm lab >/dev/null || fail "pki init"
        for host in a b; do
            "$VDSTREAM_BIN" pki issue target "$id" --out "$E2E_TMP/tls-$host" --force >/dev/null || fail "pki issue target $id"
        done
    fi
    args=(--cache "$type")
    [[ $type == ram-overflow ]] && args+=(--ram 2M)
    [[ $type == device-ram ]] && args+=(--ram 128M)
    append="vdstest=loop vdstest.keep=1 vdstest.secs=$((HOPS * 2 + 10))"
    rm -rf "$E2E_TMP/a" "$E2E_TMP/b"
    attach_on a "$id" "${args[@]}"
    pids=("$AGENT_PID")
    vm=$id-0
    start_vm_qmp "$vm" "$(drive_on a "$id")" "$append"
    src=a dst=b
    for ((hop = 1; hop <= HOPS; hop++)); do
        # Three write-and-verify rounds (768 KiB of new files) between migrations: each
        # moves more cache than the one before.
        wait_serial "$vm" "^VDSTEST ROUND $((hop * 3)) ok" 60
        attach_on "$dst" "$id" "${args[@]}" --incoming "$(source_of "$src" "$id")"
        pids[hop]=$AGENT_PID
        next=$id-$hop
        start_vm_qmp "$next" "$(drive_on "$dst" "$id")" "$append" "unix:$E2E_TMP/$next.mig"
        VDSTREAM_RUN_DIR=$E2E_TMP/$src/run "$VDSTREAM_BIN" target migrate "$id" \
            --qmp "$E2E_TMP/$vm.qmp" --to "unix:$E2E_TMP/$next.mig" --json >"$E2E_TMP/$next.json" 2>"$E2E_TMP/$next.err" ||
            fail "$type hop $hop ($src to $dst): target migrate: $(cat "$E2E_TMP/$next.err")"
        if [[ $type == ram-overflow && $hop == "$HOPS" ]]; then
            # What moved last came partly out of the overflow file.
            # (`target status` of an agent that ended prints its last status and exits 6.)
            file=$({ VDSTREAM_RUN_DIR=$E2E_TMP/$src/run "$VDSTREAM_BIN" target status "$id" --json 2>/dev/null || true; } |
                "$PY" -c 'import json,sys; print(json.load(sys.stdin)["cache"]["file_bytes"])')
            ((file > 0)) || fail "$type: the source's cache never overflowed to its file before hop $hop"
        fi
        # Both agents learnt qemu's downtime at the commit: the destination's status (and so
        # the console and the audit trail) shows it, once its status file is written again (1 s).
        want=$(json_get "$E2E_TMP/$next.json" 'j["qemu"]["downtime_ms"]')
        for ((i = 0; i < 30; i++)); do
            got=$({ VDSTREAM_RUN_DIR=$E2E_TMP/$dst/run "$VDSTREAM_BIN" target status "$id" --json 2>/dev/null || true; } |
                "$PY" -c 'import json,sys; print((json.load(sys.stdin).get("migration") or {}).get("qemu_downtime_ms"))')
            [[ $got == "$want" ]] && break
            sleep 0.1
        done
        assert_eq "$type hop $hop: qemu's downtime in the destination's status" "$got" "$want"
        log "$type hop $hop ($src to $dst): $("$PY" -c "import json,sys; j=json.load(open(sys.argv[1])); q=j['qemu']; h=j['handover']; print(f\"qemu downtime {q['downtime_ms']} ms, total {q['total_ms']} ms; cache {h['rounds']} rounds, {h['data_bytes']>>10} KiB moved, final delta {h['final_bytes']>>10} KiB, fenced {h['fenced_ms']} ms\")" "$E2E_TMP/$next.json")"
        # The source agent ends by itself once it handed over; its qemu waits in postmigrate.
        for ((i = 0; i < 100; i++)); do kill -0 "${pids[hop - 1]}" 2>/dev/null || break; sleep 0.1; done
        kill -0 "${pids[hop - 1]}" 2>/dev/null && fail "$type hop $hop: the source agent did not end after the handover"
        rc=0
        wait "${pids[hop - 1]}" || rc=$?
        assert_eq "$type hop $hop: the source agent's exit status" "$rc" 0
        quit_vm "$vm"
        vm=$next
        tmp=$src src=$dst dst=$tmp
    done
    wait_migrated_vm "$vm" 120
    console=$(guest_console "$id-0" $(for ((h = 1; h <= HOPS; h++)); do echo "$id-$h"; done) | tr -d '\r')
    grep -q '^VDSTEST ROUND [0-9]* bad' <<<"$console" && fail "$type: a round read back other bytes than it wrote"
    grep -q '^VDSTEST FAIL' <<<"$console" && fail "$type: $(grep -a '^VDSTEST FAIL' <<<"$console" | head -n 3)"
    grep -q '^VDSTEST LOOP VERIFIED files=[1-9]' <<<"$console" || fail "$type: the guest did not verify its files at the end"
    rounds=$(grep -c '^VDSTEST ROUND [0-9]* ok' <<<"$console")
    # The last agent still serves: its disk is the guest's, as it left it.
    fsck_served "nbd+unix:///?socket=$E2E_TMP/$src/run/$id.sock"
    log "ok: $type over ${link:-the migration socket}: $HOPS live migrations, $rounds write-and-verify rounds, every file verified, no I/O error, e2fsck clean"
    stop_server "${pids[HOPS]}" 15 || fail "$type: the last agent did not stop cleanly"
done
rc=0
stop_server "$SERVER_PID" 15 || rc=$?
assert_eq "server exit status" "$rc" 0
