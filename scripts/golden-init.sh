#!/bin/sh
# /sbin/init of the golden image that scripts/make-golden-image builds: the guest's test
# program. It runs under busybox sh inside the guest, never on the host. The kernel command
# line chooses what it does (see make-golden-image --help); every line it prints for the
# host starts with "VDSTEST ", and it always ends with `VDSTEST DONE status=ok|fail` and a
# power-off, so a host reading the serial log knows the guest finished.
export PATH=/bin:/sbin:/usr/bin:/usr/sbin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev 2>/dev/null
mount -t tmpfs tmp /tmp

say() { echo "VDSTEST $*"; }
status=ok
failed() { say "FAIL $*"; status=fail; }
uptime_s() { cut -d' ' -f1 /proc/uptime; }
since() { awk -v a="$1" -v b="$(uptime_s)" 'BEGIN { printf "%.2f", b - a }'; }
arg() { # arg NAME DEFAULT — the value of NAME=... on the kernel command line
    v=$(tr ' ' '\n' </proc/cmdline | sed -n "s/^$1=//p" | tail -n1)
    echo "${v:-$2}"
}

mode=$(arg vdstest boot)
tag=$(arg vdstest.tag boot)
mb=$(arg vdstest.mb 4)
secs=$(arg vdstest.secs 20)
rounds=$(arg vdstest.rounds 3)
say "BOOTED uptime=$(uptime_s) mode=$mode"

# Who this machine is (a network-booted target gets its name and machine-id from its record)
# and what its root is: /dev/vda (a VM on a host's agent) or /dev/nbd0 (a network boot).
say "HOST name=$(hostname) machine_id=$(cat /etc/machine-id 2>/dev/null) root=$(awk '$2 == "/" { print $1 }' /proc/mounts | tail -n1)"

# A network-booted machine: its agent's status file in the /run the initramfs moved under
# this root, which `vdstream target status` reads here. fresh=yes: the agent (rewriting it
# every second) still writes it after switch_root.
for f in /run/vdstream/*.status.json; do
    [ -f "$f" ] || continue
    sleep 3
    age=$(($(date +%s) - $(stat -c %Y "$f")))
    fresh=no
    [ "$age" -le 2 ] && fresh=yes
    say "AGENT-STATUS $(basename "$f") state=$(sed -n 's/.*"state": *"\([a-z-]*\)".*/\1/p' "$f" | head -n1) fresh=$fresh age=$age"
done

# The root must be writable (a read-only vDisk would show here first).
if grep -Eq '^/dev/(vda|nbd0) / ext4 rw' /proc/mounts && touch /.vdstest-rw && rm /.vdstest-rw; then
    say "RW ok"
else
    failed "root is not writable: $(grep ' / ' /proc/mounts)"
    say "RW fail"
fi

# What earlier boots left: each TAG.bin checked against the sha256 written with it.
for sum in /var/lib/vdstest/*.sha256; do
    [ -e "$sum" ] || continue
    t=$(basename "$sum" .sha256)
    if (cd /var/lib/vdstest && sha256sum -c -s "$t.sha256"); then say "SEES $t ok"; else failed "SEES $t bad"; fi
done

# workload ROUNDS — real file-system work through the guest's ext4 and journal: copy the
# /usr/lib/modules tree (about a hundred files, over 20 MiB) with tar and sync; write 200
# small files (4 KiB, a sync every 20, as an application saving its state does) and
# append to a log; list it all, remove it and sync again; ROUNDS times. Prints one
# WORKLOAD line per round.
workload() {
    n=$(find /usr/lib/modules -type f | wc -l)
    r=1
    while [ "$r" -le "$1" ]; do
        t0=$(uptime_s)
        mkdir -p /var/tmp/work/small
        tar -C /usr/lib -cf - modules | tar -C /var/tmp/work -xf - || failed "tar round $r"
        sync
        i=1
        while [ "$i" -le 200 ]; do
            head -c 4096 /dev/urandom >"/var/tmp/work/small/f$i"
            echo "round $r file $i" >>/var/log/vdstest-workload.log
            [ $((i % 20)) -ne 0 ] || sync
            i=$((i + 1))
        done
        got=$(find /var/tmp/work -type f | wc -l)
        [ "$got" = "$((n + 200))" ] || failed "round $r made $got of $((n + 200)) files"
        rm -rf /var/tmp/work
        sync
        say "WORKLOAD round=$r files=$got secs=$(since "$t0")"
        r=$((r + 1))
    done
}

case $mode in
boot | check) ;;
write)
    mkdir -p /var/lib/vdstest
    cd /var/lib/vdstest || failed "cd /var/lib/vdstest"
    dd if=/dev/urandom of="$tag.bin" bs=1M count="$mb" 2>/dev/null || failed "dd $tag.bin"
    sha256sum "$tag.bin" >"$tag.sha256"
    sync
    cd /
    say "WROTE $tag mb=$mb"
    ;;
loop)
    # vdstest.keep=1: each round writes one of 64 files of 256 KiB (slot i mod 64) and keeps
    # its checksum, and at the end every file is read back (page cache dropped) against its
    # last checksum: what a migrated guest wrote anywhere along the way is all there.
    keep=$(arg vdstest.keep 0)
    t0=$(uptime_s)
    i=0
    mkdir -p /var/tmp/loop
    while awk -v a="$t0" -v b="$(uptime_s)" -v s="$secs" 'BEGIN { exit !(b - a < s) }'; do
        i=$((i + 1))
        if [ "$keep" = 1 ]; then
            f=/var/tmp/loop/f$((i % 64)).bin
            dd if=/dev/urandom of="$f" bs=256k count=1 2>/dev/null
            (cd /var/tmp/loop && sha256sum "$(basename "$f")" >"$(basename "$f").sha256")
        else
            f=/var/tmp/loop.bin
            dd if=/dev/urandom of="$f" bs=1M count=1 2>/dev/null
        fi
        want=$(sha256sum <"$f")
        sync
        echo 3 >/proc/sys/vm/drop_caches
        if [ "$(sha256sum <"$f")" = "$want" ]; then say "ROUND $i ok"; else failed "ROUND $i bad"; fi
        sleep "$(arg vdstest.pause 0.5)"
    done
    if [ "$keep" = 1 ]; then
        sync
        echo 3 >/proc/sys/vm/drop_caches
        n=0
        for sum in /var/tmp/loop/*.sha256; do
            [ -e "$sum" ] || continue
            n=$((n + 1))
            (cd /var/tmp/loop && sha256sum -c -s "$(basename "$sum")") || failed "LOOP $(basename "$sum" .sha256) bad"
        done
        say "LOOP VERIFIED files=$n rounds=$i"
    fi
    ;;
fio)
    # The VDI profile (job.fio: an image made with make-golden-image --fio) on a file of the
    # root file system, as an application in the guest sees its disk: libaio, O_DIRECT.
    job=/usr/share/vdstest/job.fio
    if [ ! -x /usr/bin/fio ] || [ ! -f "$job" ]; then
        failed "no fio in this image (scripts/make-golden-image --fio JOBFILE)"
    else
        out=$(fio "$job" --filename=/var/tmp/vdstest.fio --size="$(arg vdstest.fio_size 64m)" --runtime="$secs" \
            --ioengine=libaio --direct=1 --output-format=terse --terse-version=3 2>&1)
        line=$(echo "$out" | grep '^3;' | tail -n1)
        if [ -n "$line" ]; then
            echo "$line" | awk -F';' '{ printf "VDSTEST FIO iops=%d read_iops=%d write_iops=%d\n", $8 + $49, $8, $49 }'
        else
            failed "fio: $(echo "$out" | tail -n3 | tr '\n' ' ')"
        fi
        rm -f /var/tmp/vdstest.fio
    fi
    ;;
workload)
    workload "$rounds"
    if [ "$(arg vdstest.fstrim 0)" = 1 ]; then
        # What a guest's periodic fstrim does: tell the disk which blocks are free.
        out=$(fstrim -v / 2>&1) || failed "fstrim: $out"
        say "FSTRIM $out"
    fi
    ;;
*) failed "unknown mode vdstest=$mode" ;;
esac

# The kernel's I/O errors (a failover that leaked an error to the guest shows here).
say "KERNEL-IO-ERRORS n=$(dmesg | grep -ciE 'i/o error|ext4-fs error|blk_update_request|buffer i/o')"
# vdstest.dump=DEV: the root, remounted read-only, copied whole to DEV (a spare drive), so
# the host can e2fsck what this machine's root was (its cache lives in the machine).
dump=$(arg vdstest.dump "")
if [ -n "$dump" ]; then
    root=$(awk '$2 == "/" { print $1 }' /proc/mounts | tail -n1)
    sync
    if mount -o remount,ro / && dd if="$root" of="$dump" bs=1M 2>/dev/null && sync; then
        say "DUMPED $root to $dump"
    else
        failed "dumping $root to $dump"
    fi
fi

sync
say "DONE status=$status uptime=$(uptime_s)"
poweroff -f
