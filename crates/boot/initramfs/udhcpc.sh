#!/bin/sh
# udhcpc's script in a vdstream network-boot initramfs (crates/boot): sets the lease's
# address, routes and DNS servers on $interface. udhcpc runs it with $1 = the event.
case $1 in
deconfig)
    ip -4 addr flush dev "$interface"
    ip link set "$interface" up
    ;;
bound | renew)
    ip -4 addr flush dev "$interface"
    ip -4 addr add "$ip/${mask:-24}" ${broadcast:+broadcast "$broadcast"} dev "$interface"
    for r in $router; do
        ip -4 route add default via "$r" dev "$interface" 2>/dev/null && break
    done
    : >/etc/resolv.conf
    [ -z "$domain" ] || echo "search $domain" >>/etc/resolv.conf
    for s in $dns; do echo "nameserver $s" >>/etc/resolv.conf; done
    [ -z "$hostname" ] || [ -n "$(grep -o 'vdstream.hostname=[^ ]*' /proc/cmdline)" ] || hostname "$hostname"
    ;;
esac
exit 0
