#!/bin/busybox sh
# /init of a vdstream network-boot initramfs (built by crates/boot: `vdstream initrd build`
# or the boot service of `vdstream server`). It runs under busybox sh in the target:
#   mount /proc /sys /dev /run; insmod the modules of /etc/vdstream/modules in order (the
#   builder put there everything modprobe would load: soft dependencies, alias modules);
#   read the vdstream.* parameters of /proc/cmdline (crates/boot/src/cmdline.rs);
#   bring up every ethernet link with udhcpc (bounded rounds);
#   `vdstream target attach ... --booting --kernel-nbd /dev/nbd0 --daemon` (waits for a
#   boot place, then the agent serves the vDisk with the target's write cache to the
#   kernel's NBD driver and keeps running); mount /dev/nbd0 on /newroot, write the
#   personality (hostname, machine-id: into the write cache, never the vDisk), say
#   `vdstream target booted` (the boot place goes back) and switch_root to /sbin/init.
# Every console line starts with "vdstream-init: ". On a failure it prints
# "vdstream-init: FAILED: WHAT" and then, as vdstream.on_fail says: `reboot` (default:
# after 10 s the machine boots again from the network), `shell` (a busybox shell on the
# console; leaving it retries the boot from the start) or `halt` (power off).
/bin/busybox mkdir -p /bin /sbin /usr/bin /usr/sbin
/bin/busybox --install -s
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mkdir -p /proc /sys /dev /run /tmp /newroot
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null
mount -t tmpfs -o mode=0755,nosuid run /run
exec </dev/console >/dev/console 2>&1

say() { echo "vdstream-init: $*"; }
arg() { # arg NAME — every value of NAME=... on the kernel command line, one a line
    tr ' ' '\n' </proc/cmdline | sed -n "s/^$1=//p"
}
on_fail=$(arg vdstream.on_fail | tail -n1)
failed() {
    say "FAILED: $*"
    case $on_fail in
    shell)
        say "a shell on the console; leave it (exit) to try the boot again"
        # In a subshell (not a process-group leader), setsid needs no fork: the wait is real.
        (exec setsid -c sh </dev/console >/dev/console 2>&1)
        exec /init
        ;;
    halt)
        say "powering off (vdstream.on_fail=halt)"
        sleep 2
        poweroff -f
        ;;
    *)
        say "rebooting in 10 s to boot again from the network (vdstream.on_fail=shell gives a shell instead)"
        sleep 10
        reboot -f
        ;;
    esac
    sleep 30
    exit 1
}

say "vdstream network boot: kernel $(uname -r)"
# One module a line, in load order; "NAME optional": one of several modules that answer an
# alias (crc32c_intel and crc32c_generic), which may refuse a machine it is not for
# ("No such device": a CPU without SSE4.2) while another one serves.
while read -r m how; do
    [ -n "$m" ] || continue
    insmod "/lib/modules/$m.ko" 2>/tmp/insmod.err || grep -q 'File exists' /tmp/insmod.err ||
        { [ "$how" = optional ] && grep -q 'No such device' /tmp/insmod.err; } ||
        say "warning: insmod $m: $(cat /tmp/insmod.err)"
done </etc/vdstream/modules

target=$(arg vdstream.target | tail -n1)
servers=$(arg vdstream.server)
vdisk=$(arg vdstream.vdisk | tail -n1)
cache=$(arg vdstream.cache | tail -n1)
ram=$(arg vdstream.ram | tail -n1)
overflow=$(arg vdstream.overflow | tail -n1)
host=$(arg vdstream.hostname | tail -n1)
machine_id=$(arg vdstream.machine_id | tail -n1)
[ -n "$target" ] || failed "no vdstream.target=ID on the kernel command line (the boot service's script sets it)"
[ -n "$servers" ] || failed "no vdstream.server=URL on the kernel command line"
[ -n "$vdisk" ] || failed "no vdstream.vdisk=NAME@V on the kernel command line"

# ---- network: every ethernet link, DHCP, bounded
ip link set lo up
links() {
    for d in /sys/class/net/*; do
        n=${d##*/}
        [ "$n" != lo ] && [ "$(cat "$d/type" 2>/dev/null)" = 1 ] && echo "$n"
    done
}
i=0
while [ -z "$(links)" ]; do
    i=$((i + 1))
    [ $i -le 100 ] || failed "no ethernet interface after 10 s (is the NIC's driver among the initramfs's modules? vdstream initrd build --module NAME)"
    [ $i -ne 20 ] || say "waiting for an ethernet interface to appear"
    sleep 0.1
done
leased=
round=1
while [ -z "$leased" ] && [ $round -le 5 ]; do
    for n in $(links); do
        ip link set "$n" up
        say "waiting for a DHCP lease on $n (round $round of 5)"
        if udhcpc -i "$n" -s /etc/vdstream/udhcpc.script -t 4 -T 2 -A 1 -n -q -f >/tmp/udhcpc.$n 2>&1; then
            leased="$leased $n"
            say "$n: $(ip -4 -o addr show dev "$n" | awk '{print $4}')"
        fi
    done
    round=$((round + 1))
done
[ -n "$leased" ] || failed "no DHCP lease on $(links | tr '\n' ' ')after 5 rounds (is a DHCP server on this network?)"
if [ -n "$host" ]; then hostname "$host"; fi

# ---- the agent: attach, the vDisk to /dev/nbd0
set -- target attach "$target"
for s in $servers; do set -- "$@" --server "$s"; done
set -- "$@" --vdisk "$vdisk" --cache "${cache:-ram-overflow}"
[ -z "$ram" ] || set -- "$@" --ram "$ram"
[ -z "$overflow" ] || set -- "$@" --overflow-device "$overflow"
# --booting: wait for a place in the server's boot window first (--max-booting).
set -- "$@" --booting --kernel-nbd /dev/nbd0 --daemon
[ -b /dev/nbd0 ] || failed "no /dev/nbd0 (the kernel has no nbd driver: is nbd.ko in the vDisk's /lib/modules?)"
say "attaching: vdstream $*"
export VDSTREAM_RUN_DIR=/run/vdstream
# The serial console keeps plain text: no colour codes in the agent's log.
export NO_COLOR=1
mkdir -p "$VDSTREAM_RUN_DIR"
/bin/vdstream "$@" || failed "vdstream target attach exited with status $? (its message is above)"

# ---- the root file system
mount -t ext4 -o rw /dev/nbd0 /newroot || failed "mounting /dev/nbd0 (the vDisk $vdisk) as ext4 on /newroot"
[ -x /newroot/sbin/init ] || [ -L /newroot/sbin/init ] || failed "the vDisk $vdisk has no /sbin/init"
if [ -d /newroot/etc ]; then
    # Personality: into the target's write cache, never the vDisk.
    if [ -n "$host" ]; then echo "$host" >/newroot/etc/hostname; fi
    case $machine_id in
    "") ;;
    *[!0-9a-f]*) say "warning: vdstream.machine_id=$machine_id is not 32 lower-case hex digits; not written" ;;
    *) if [ ${#machine_id} -eq 32 ]; then echo "$machine_id" >/newroot/etc/machine-id; else say "warning: vdstream.machine_id is not 32 hex digits; not written"; fi ;;
    esac
fi
[ ! -f /etc/resolv.conf ] || [ ! -d /newroot/etc ] || cp /etc/resolv.conf /newroot/etc/resolv.conf 2>/dev/null || true
# The root is up: give the boot place back, so the next machine waiting may boot (the
# server closes it by itself after --boot-window if this fails).
set --
for s in $servers; do set -- "$@" --server "$s"; done
/bin/vdstream target booted "$target" "$@" >/tmp/booted.log 2>&1 || say "warning: $(tail -n1 /tmp/booted.log)"
# The agent's status files and the kernel's file systems move with the root.
for d in run dev proc sys; do
    if [ -d "/newroot/$d" ]; then mount --move "/$d" "/newroot/$d"; else umount -l "/$d"; fi
done
say "switching root to the vDisk $vdisk"
exec switch_root /newroot /sbin/init
