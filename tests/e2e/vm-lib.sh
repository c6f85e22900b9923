# shellcheck shell=bash
# tests/e2e/vm-lib.sh — real Linux guests for the test-vm-*.sh tests (source after lib.sh):
#
#   vm_test_init NAME          a VM test's start: require_vdstream, e2e_init, require_vm,
#                              store_init and vm_store NAME
#   require_vm                 skip unless qemu-system-x86_64 is installed and the golden
#                              image can be built (scripts/make-golden-image: Debian's
#                              kernel and busybox, downloaded once into target/golden-cache)
#   vm_store NAME              import the golden image into $STORE as vDisk NAME
#   golden_image               build (once per change of its scripts) the golden image into
#                              $GOLDEN (target/golden-image): vmlinuz, initrd.img, golden.img
#   vm_accel                   kvm where a short probe boot of the golden image under KVM
#                              finishes, else tcg (VDSTREAM_VM_ACCEL=tcg|kvm decides
#                              instead); the answer is kept in $GOLDEN/accel (no golden
#                              image built: tcg, not kept)
#   start_vm NAME URI APPEND   boot a guest in the background from the NBD export URI
#                              (nbd+unix:///EXPORT?socket=PATH: an agent's socket, or the
#                              server's maintenance/NAME), kernel command line += APPEND (vdstest=MODE ...);
#                              serial console to $E2E_TMP/NAME.serial; sets VM_PID
#   wait_vm NAME PID [SECS]    wait (bounded, default VM_SECS) for the guest to power off;
#                              fails unless it printed `VDSTEST DONE status=ok`
#   boot_vm NAME URI APPEND [SECS]  start_vm + wait_vm
#   fsck_served URI            copy the disk URI serves (qemu-img convert) and run
#                              `e2fsck -fn` on it: fails unless the file system is clean
#   serial_has NAME REGEX      the guest's serial log has a line matching REGEX
#   vm_storm N PREFIX URI APPEND AGENT_ARGS...
#                              N agents and N guests booting at once (see the function)
#   vm_secs NAME               wall-clock seconds from qemu's start to the guest's power-off
#   booted_uptime NAME         the guest's uptime when its /sbin/init started
#   start_vm_vhost NAME SOCKET APPEND [QUEUES]
#                              as start_vm, the disk a vhost-user-blk device on the unix
#                              socket SOCKET (an agent's --vhost-user, or qemu-storage-daemon)
#                              with QUEUES queues (default 1; >1 gives the guest 2 vCPUs so
#                              that the queues are used); guest RAM is a shared memfd, the
#                              chardev reconnects every second; sets VM_PID
#   boot_vm_vhost NAME SOCKET APPEND [QUEUES] [SECS]  start_vm_vhost + wait_vm
#   vm_chardev_reconnect       the chardev's reconnect option this qemu knows:
#                              reconnect-ms=1000 (qemu >= 9.2; 10.2 dropped reconnect=),
#                              else reconnect=1
#   start_qsd_vhost IMG SOCKET [QUEUES]
#                              qemu-storage-daemon exporting the raw IMG writable (discard
#                              passed down) as vhost-user-blk on SOCKET: a stand-in backend;
#                              waits (bounded) for the socket; sets QSD_PID
#
# Guests: -m 192M, one vCPU, no network, the disk with discard=unmap (fstrim reaches the
# write cache as NBD TRIM), -no-reboot (a kernel panic ends qemu), every run
# bounded by `timeout`.

GOLDEN=$REPO_ROOT/target/golden-image
# GOLDEN_FIO=JOBFILE (set after sourcing, with another GOLDEN): the image also carries fio
# and JOBFILE (make-golden-image --fio), for vdstest=fio; bench/pxe-boot.sh uses it.
GOLDEN_FIO=
VM_SECS=${VDSTREAM_VM_SECS:-120}
VM_PID=

# vm_store NAME — the golden image imported into $STORE (store_init first) as vDisk NAME.
vm_store() {
    "$VDSTREAM_BIN" vdisk import "$1" "$GOLDEN/golden.img" --store "$STORE" >/dev/null ||
        fail "vdstream vdisk import $1 $GOLDEN/golden.img failed"
}

vm_test_init() {
    require_vdstream
    e2e_init
    require_vm
    store_init
    vm_store "$1"
}

require_vm() {
    require qemu-system-x86_64
    golden_image
}

golden_image() {
    local stamp want
    local args=()
    [[ -z $GOLDEN_FIO ]] || args=(--fio "$GOLDEN_FIO")
    want=$(cat "$REPO_ROOT/scripts/make-golden-image" "$REPO_ROOT/scripts/golden-init.sh" ${GOLDEN_FIO:+"$GOLDEN_FIO"} | cksum)
    stamp=$GOLDEN/.stamp
    if [[ -f $stamp && $(cat "$stamp") == "$want" && -f $GOLDEN/golden.img ]]; then
        return 0
    fi
    log "building the golden image into $GOLDEN"
    if ! "$REPO_ROOT/scripts/make-golden-image" "$GOLDEN" "${args[@]}" >"$E2E_TMP/golden.log" 2>&1; then
        cat "$E2E_TMP/golden.log" >&2
        # No package lists or no network: a machine that cannot build it skips.
        if grep -q 'apt-get download\|apt-cache knows no\|is needed' "$E2E_TMP/golden.log"; then
            skip "cannot build the golden image: $(tail -n1 "$E2E_TMP/golden.log")"
        fi
        fail "scripts/make-golden-image failed"
    fi
    echo "$want" >"$stamp"
    rm -f "$GOLDEN/accel"
}

# qemu_argv ACCEL LOG APPEND DRIVE — the qemu command line (NUL-separated).
qemu_argv() {
    local accel=$1 serial=$2 append=$3 drive=$4
    printf '%s\0' qemu-system-x86_64 -accel "$accel" -m 192M -smp 1 -nographic -no-reboot \
        -nic none -monitor none -serial "file:$serial" \
        -kernel "$GOLDEN/vmlinuz" -initrd "$GOLDEN/initrd.img" \
        -append "$(cat "$GOLDEN/cmdline") $append" -drive "$drive,discard=unmap"
}

vm_accel() {
    local accel=${VDSTREAM_VM_ACCEL:-} probe argv=()
    if [[ -n $accel ]]; then echo "$accel"; return; fi
    if [[ -f $GOLDEN/accel ]]; then cat "$GOLDEN/accel"; return; fi
    accel=tcg
    # The probe boots the golden image: a test without it runs with tcg, and the answer is
    # not kept (it was not probed).
    if [[ ! -f $GOLDEN/golden.img ]]; then echo "$accel"; return; fi
    if [[ -r /dev/kvm && -w /dev/kvm ]]; then
        # KVM can be there and still not run a guest (nested virtualisation): boot a
        # throw-away copy of the image for at most 15 s.
        probe=$E2E_TMP/kvm-probe
        cp --sparse=always "$GOLDEN/golden.img" "$probe.img"
        mapfile -d '' argv < <(qemu_argv kvm "$probe.serial" vdstest=boot "file=$probe.img,format=raw,if=virtio")
        timeout --kill-after=2 15 "${argv[@]}" >/dev/null 2>&1 </dev/null || true
        if grep -aq 'VDSTEST DONE status=ok' "$probe.serial" 2>/dev/null; then accel=kvm; fi
        rm -f "$probe.img"
    fi
    echo "$accel" >"$GOLDEN/accel"
    log "guests run with -accel $accel"
    echo "$accel"
}

start_vm() {
    local name=$1 uri=$2 append=$3 accel argv=()
    accel=$(vm_accel)
    mapfile -d '' argv < <(qemu_argv "$accel" "$E2E_TMP/$name.serial" "$append" \
        "file=$uri,format=raw,if=virtio")
    date +%s.%N >"$E2E_TMP/$name.started"
    timeout --kill-after=5 "$VM_SECS" "${argv[@]}" >"$E2E_TMP/$name.qemu.log" 2>&1 </dev/null &
    VM_PID=$!
    track_pid "$VM_PID"
    log "guest $name booting (pid $VM_PID, $accel): $append"
}

wait_vm() {
    local name=$1 pid=$2 secs=${3:-$VM_SECS} rc=0 i
    for ((i = 0; i < secs * 10; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    kill -0 "$pid" 2>/dev/null && { kill -TERM "$pid" 2>/dev/null; sleep 1; }
    wait "$pid" || rc=$?
    # The guest's last console line (its power-off) dates its end, however late we wait.
    stat -c %.9Y "$E2E_TMP/$name.serial" >"$E2E_TMP/$name.ended" 2>/dev/null || date +%s.%N >"$E2E_TMP/$name.ended"
    if ! grep -aq 'VDSTEST DONE status=ok' "$E2E_TMP/$name.serial" 2>/dev/null; then
        echo "---- guest $name: qemu (exit $rc) ----" >&2
        cat "$E2E_TMP/$name.qemu.log" >&2 || true
        echo "---- guest $name: serial console (last 30 lines) ----" >&2
        tail -n 30 "$E2E_TMP/$name.serial" >&2 || true
        fail "guest $name did not finish with VDSTEST DONE status=ok (qemu exit $rc)"
    fi
    ((rc == 0)) || fail "guest $name: qemu exited with status $rc"
    log "ok: guest $name powered off: $(grep -a 'VDSTEST DONE' "$E2E_TMP/$name.serial" | tr -d '\r')"
}

boot_vm() {
    start_vm "$1" "$2" "$3"
    wait_vm "$1" "$VM_PID" "${4:-$VM_SECS}"
}

serial_has() { grep -aEq "$2" "$E2E_TMP/$1.serial" 2>/dev/null; }

# vm_secs NAME — wall-clock seconds from qemu's start to the guest's last console line (its
# power-off).
vm_secs() {
    awk -v a="$(cat "$E2E_TMP/$1.started")" -v b="$(cat "$E2E_TMP/$1.ended")" 'BEGIN { printf "%.1f", b - a }'
}

# booted_uptime NAME — the guest's uptime when its init started (kernel and initramfs).
booted_uptime() { grep -aom1 'VDSTEST BOOTED uptime=[0-9.]*' "$E2E_TMP/$1.serial" | cut -d= -f2; }

# vm_storm N PREFIX EXPORT_URI APPEND AGENT_ARGS... — N targets PREFIX1..PREFIXN, each with
# its own agent (`target attach ... --server EXPORT_URI AGENT_ARGS...`), boot at the same
# time with APPEND; waits for every guest (each must end with DONE status=ok), reads each
# agent's status, and writes one JSON line per target to $E2E_TMP/PREFIX.storm.jsonl:
# target, secs (qemu start to power-off), init_uptime, guest and storage I/O of its agent
# and what it read from the server. Prints a table of them.
vm_storm() {
    local n=$1 prefix=$2 uri=$3 append=$4 i id pid
    shift 4
    local agents=() vms=()
    for ((i = 1; i <= n; i++)); do
        start_agent "$prefix$i" --server "$uri" "$@"
        agents+=("$AGENT_PID")
    done
    vm_accel >/dev/null # probe once, before the guests start together
    for ((i = 1; i <= n; i++)); do
        start_vm "$prefix$i" "nbd+unix:///?socket=$VDSTREAM_RUN_DIR/$prefix$i.sock" "$append"
        vms+=("$VM_PID")
    done
    for ((i = 1; i <= n; i++)); do
        wait_vm "$prefix$i" "${vms[i - 1]}"
    done
    sleep 1.5 # the agents rewrite their status files every second
    : >"$E2E_TMP/$prefix.storm.jsonl"
    for ((i = 1; i <= n; i++)); do
        id=$prefix$i
        "$VDSTREAM_BIN" target status "$id" --json >"$E2E_TMP/$id.status.json" || fail "target status $id failed"
        "$PY" - "$E2E_TMP/$id.status.json" "$id" "$(vm_secs "$id")" "$(booted_uptime "$id")" \
            >>"$E2E_TMP/$prefix.storm.jsonl" <<'PYEOF'
import json, sys
j = json.load(open(sys.argv[1]))
print(json.dumps({"target": sys.argv[2], "secs": float(sys.argv[3]), "init_uptime": float(sys.argv[4]),
                  "cache": j["cache"]["type"], "guest": j["guest"], "storage": j["storage"],
                  "from_server_bytes": j["server"]["read_bytes"]}))
PYEOF
    done
    "$PY" - "$E2E_TMP/$prefix.storm.jsonl" <<'PYEOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("boot s: host wall clock, qemu start to power-off; init at: the guest's uptime when its init started,\n"
      "by the guest's clock (the HPET: tsc=unstable)")
print(f"{'target':<10} {'boot s':>7} {'init at':>8} {'guest rd KiB':>13} {'guest wr KiB':>13} {'storage wr KiB':>15} {'from server KiB':>16}")
for r in rows:
    print(f"{r['target']:<10} {r['secs']:>7.1f} {r['init_uptime']:>8.2f} {r['guest']['read_bytes'] >> 10:>13} "
          f"{r['guest']['write_bytes'] >> 10:>13} {r['storage']['write_bytes'] >> 10:>15} {r['from_server_bytes'] >> 10:>16}")
PYEOF
    for pid in "${agents[@]}"; do stop_server "$pid" 15 || fail "an agent of the storm did not stop cleanly"; done
}

fsck_served() {
    local uri=$1 img=$E2E_TMP/fsck.img
    qemu-img convert -f raw -O raw "$uri" "$img" || fail "reading $uri for e2fsck failed"
    e2fsck -fn "$img" >"$E2E_TMP/fsck.log" 2>&1 || { cat "$E2E_TMP/fsck.log" >&2; fail "e2fsck -fn found errors in the disk $uri serves"; }
    rm -f "$img"
}

vm_chardev_reconnect() {
    local maj=0 min=0
    read -r maj min < <(qemu-system-x86_64 --version | sed -n '1s/.* version \([0-9]*\)\.\([0-9]*\).*/\1 \2/p') || true
    if ((maj > 9 || (maj == 9 && min >= 2))); then echo reconnect-ms=1000; else echo reconnect=1; fi
}

# qemu_vhost_argv ACCEL LOG APPEND SOCKET QUEUES — as qemu_argv, the disk a vhost-user-blk
# device: the backend maps the guest's RAM, so that RAM is a shared memfd (NUMA node 0).
qemu_vhost_argv() {
    local accel=$1 serial=$2 append=$3 sock=$4 queues=$5 smp=1
    if ((queues > 1)); then smp=2; fi
    printf '%s\0' qemu-system-x86_64 -accel "$accel" -m 192M -smp "$smp" -nographic -no-reboot \
        -nic none -monitor none -serial "file:$serial" \
        -kernel "$GOLDEN/vmlinuz" -initrd "$GOLDEN/initrd.img" \
        -append "$(cat "$GOLDEN/cmdline") $append" \
        -object memory-backend-memfd,id=mem,size=192M,share=on -numa node,memdev=mem \
        -chardev "socket,id=c0,path=$sock,$(vm_chardev_reconnect)" \
        -device "vhost-user-blk-pci,chardev=c0,num-queues=$queues"
}

start_vm_vhost() {
    local name=$1 sock=$2 append=$3 queues=${4:-1} accel argv=()
    accel=$(vm_accel)
    mapfile -d '' argv < <(qemu_vhost_argv "$accel" "$E2E_TMP/$name.serial" "$append" "$sock" "$queues")
    date +%s.%N >"$E2E_TMP/$name.started"
    timeout --kill-after=5 "$VM_SECS" "${argv[@]}" >"$E2E_TMP/$name.qemu.log" 2>&1 </dev/null &
    VM_PID=$!
    track_pid "$VM_PID"
    log "guest $name booting (pid $VM_PID, $accel, vhost-user-blk $sock, $queues queues): $append"
}

boot_vm_vhost() {
    start_vm_vhost "$1" "$2" "$3" "${4:-1}"
    wait_vm "$1" "$VM_PID" "${5:-$VM_SECS}"
}

QSD_PID=
start_qsd_vhost() {
    local img=$1 sock=$2 queues=${3:-1} i
    require qemu-storage-daemon
    qemu-storage-daemon \
        --blockdev "driver=file,node-name=file0,filename=$img,discard=unmap,cache.direct=off" \
        --blockdev "driver=raw,node-name=disk0,file=file0,discard=unmap" \
        --export "type=vhost-user-blk,id=exp0,node-name=disk0,addr.type=unix,addr.path=$sock,writable=on,num-queues=$queues" \
        >"$E2E_TMP/qsd.log" 2>&1 </dev/null &
    QSD_PID=$!
    track_pid "$QSD_PID"
    for ((i = 0; i < 100; i++)); do
        [[ -S $sock ]] && return 0
        kill -0 "$QSD_PID" 2>/dev/null || { cat "$E2E_TMP/qsd.log" >&2; fail "qemu-storage-daemon exited"; }
        sleep 0.1
    done
    fail "qemu-storage-daemon did not listen on $sock within 10 s"
}
