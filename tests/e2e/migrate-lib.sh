# shellcheck shell=bash
# tests/e2e/migrate-lib.sh — live migration of real guests (source after lib.sh and vm-lib.sh):
#
#   QMP                        tests/e2e/qmp.py run with $PY: `"$QMP" SOCKET cmd|migrate|
#                              continue|wait-migrate|wait-status ...` (see its --help)
#   start_vm_qmp NAME DRIVE APPEND [INCOMING]
#                              as start_vm, with a QMP socket at $E2E_TMP/NAME.qmp and DRIVE
#                              the whole -drive string (file=nbd+unix:///EXPORT?socket=PATH,
#                              format=raw,if=virtio[,cache=none]; vm-lib adds discard=unmap),
#                              or vhost:SOCKET for a vhost-user-blk disk (qemu_vhost_argv);
#                              with INCOMING (unix:$E2E_TMP/NAME.mig) the qemu waits for a
#                              migration there (-incoming) and the call returns once it
#                              listens. Serial console to $E2E_TMP/NAME.serial; sets VM_PID
#                              (also kept in $E2E_TMP/NAME.pid). Source and destination get
#                              the same machine (qemu_argv: -m, -smp, kernel, initrd, append),
#                              so APPEND must be the same on both sides.
#   migrate_vm SRC DST_URI     migrate the guest of SRC (a start_vm_qmp NAME) live to the
#                              destination listening on DST_URI; the JSON line of qmp.py
#                              migrate goes to $E2E_TMP/SRC.migrate.json; prints qemu's
#                              downtime (ms). Fails unless it completed. With
#                              MIGRATE_SWITCHOVER_HOOK set (a command, given SRC DST_URI), the
#                              source pauses before switch-over (the guest stopped, its
#                              disks still active), the hook runs, then the migration goes
#                              on: qemu's downtime includes the hook. MIGRATE_ARGS (array):
#                              more qmp.py migrate options (--param NAME=VALUE); MIGRATE_SECS
#                              bounds the migration (default 300). Called as $(migrate_vm ...)
#                              it runs in a subshell: the hook cannot set the caller's variables
#   quit_vm NAME               `quit` the qemu of NAME (a source after migration stays in
#                              postmigrate until told) and reap it, bounded
#   wait_serial NAME REGEX [SECS]   wait (bounded, default 60 s) for a line matching REGEX
#                              in NAME's serial log
#   wait_migrated_vm NAME [SECS]    wait_vm for the last destination NAME (after a switch the
#                              guest's console continues in the destination's serial log),
#                              and fail unless the guest saw no kernel I/O error
#                              (`VDSTEST KERNEL-IO-ERRORS n=0`)
#   guest_console NAME...      the guest's whole console: the serial logs of the qemus it ran
#                              in, in order
#
# Migration goes over unix sockets only; qmp.py polls query-migrate every 50 ms.

QMP=("$PY" "$E2E_DIR/qmp.py")
MIGRATE_SWITCHOVER_HOOK=
MIGRATE_ARGS=()
MIGRATE_SECS=${MIGRATE_SECS:-300}

start_vm_qmp() {
    local name=$1 drive=$2 append=$3 incoming=${4:-} accel argv=() i
    accel=$(vm_accel)
    if [[ $drive == vhost:* ]]; then
        mapfile -d '' argv < <(qemu_vhost_argv "$accel" "$E2E_TMP/$name.serial" "$append" "${drive#vhost:}" 1)
    else
        mapfile -d '' argv < <(qemu_argv "$accel" "$E2E_TMP/$name.serial" "$append" "$drive")
    fi
    argv+=(-qmp "unix:$E2E_TMP/$name.qmp,server=on,wait=off")
    [[ -z $incoming ]] || argv+=(-incoming "$incoming")
    rm -f "$E2E_TMP/$name.qmp"
    date +%s.%N >"$E2E_TMP/$name.started"
    timeout --kill-after=5 "$VM_SECS" "${argv[@]}" >"$E2E_TMP/$name.qemu.log" 2>&1 </dev/null &
    VM_PID=$!
    echo "$VM_PID" >"$E2E_TMP/$name.pid"
    track_pid "$VM_PID"
    if [[ -n $incoming ]]; then
        # QMP answers once qemu's main loop runs, after -incoming set up its listener.
        "${QMP[@]}" "$E2E_TMP/$name.qmp" wait-status inmigrate --timeout 30 >/dev/null ||
            { cat "$E2E_TMP/$name.qemu.log" >&2; fail "destination $name did not wait for a migration"; }
        if [[ $incoming == unix:* ]]; then
            for ((i = 0; i < 100; i++)); do [[ -S ${incoming#unix:} ]] && break; sleep 0.1; done
            [[ -S ${incoming#unix:} ]] || fail "destination $name does not listen on ${incoming#unix:}"
        fi
        log "destination $name waits on $incoming (pid $VM_PID, $accel)"
    else
        log "guest $name booting (pid $VM_PID, $accel, QMP $E2E_TMP/$name.qmp): $append"
    fi
}

migrate_vm() {
    local src=$1 dst=$2 qmp=$E2E_TMP/$1.qmp out=$E2E_TMP/$1.migrate.json
    if [[ -n $MIGRATE_SWITCHOVER_HOOK ]]; then
        "${QMP[@]}" "$qmp" migrate "$dst" --pause-before-switchover --timeout "$MIGRATE_SECS" "${MIGRATE_ARGS[@]}" >"$out" ||
            fail "migration of $src to $dst did not reach pre-switchover: $(cat "$out")"
        $MIGRATE_SWITCHOVER_HOOK "$src" "$dst" || fail "switch-over hook '$MIGRATE_SWITCHOVER_HOOK' failed"
        "${QMP[@]}" "$qmp" continue || fail "migrate-continue on $src failed"
        "${QMP[@]}" "$qmp" wait-migrate --timeout "$MIGRATE_SECS" >"$out" ||
            fail "migration of $src to $dst: $(cat "$out")"
    else
        "${QMP[@]}" "$qmp" migrate "$dst" --timeout "$MIGRATE_SECS" "${MIGRATE_ARGS[@]}" >"$out" ||
            fail "migration of $src to $dst: $(cat "$out")"
    fi
    json_get "$out" 'j["downtime"]'
}

quit_vm() {
    local name=$1 pid i
    pid=$(cat "$E2E_TMP/$name.pid")
    "${QMP[@]}" "$E2E_TMP/$name.qmp" cmd quit >/dev/null 2>&1 || true
    for ((i = 0; i < 100; i++)); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    stop_pid "$pid" 5
    wait "$pid" 2>/dev/null || true
}

wait_serial() {
    local name=$1 re=$2 secs=${3:-60} i
    for ((i = 0; i < secs * 10; i++)); do
        serial_has "$name" "$re" && return 0
        sleep 0.1
    done
    fail "guest $name: no console line matching '$re' within ${secs}s (last: $(tail -n1 "$E2E_TMP/$name.serial" 2>/dev/null | tr -d '\r'))"
}

wait_migrated_vm() {
    local name=$1
    wait_vm "$name" "$(cat "$E2E_TMP/$name.pid")" "${2:-$VM_SECS}"
    serial_has "$name" 'VDSTEST KERNEL-IO-ERRORS n=0' ||
        fail "guest $name saw kernel I/O errors: $(grep -a 'KERNEL-IO-ERRORS' "$E2E_TMP/$name.serial" | tr -d '\r')"
}

guest_console() {
    local name
    for name in "$@"; do cat "$E2E_TMP/$name.serial" 2>/dev/null || true; done
}
