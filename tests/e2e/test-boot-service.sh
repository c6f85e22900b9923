#!/usr/bin/env bash
# The boot service of `vdstream server --boot` with real clients: target records take
# --mac (normalised, unique, shown by list/show); curl, as iPXE would, gets the first
# script, a known MAC's script (kernel URL and vdstream.* command line naming the server by
# the Host it was asked at), an unknown MAC's refusal (and the log line naming it), and a
# version without a kernel is named; curl's TFTP client gets Debian's undionly.kpxe (and
# undionly.0, what dnsmasq asks for) byte for byte, while paths out of the folder, sub-
# folders and writes are refused.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
source "$(dirname "$0")/api-lib.sh"
require curl
require_vdstream
curl --version | grep -qw tftp || skip "this curl has no TFTP"
IPXE=/usr/lib/ipxe/undionly.kpxe
[[ -f $IPXE ]] || skip "$IPXE is missing: apt-get install ipxe"
e2e_init
store_init

vds vdisk create win --size 16M >/dev/null
vds target add pc1 --vdisk win --cache ram-overflow --ram 256M --mac 52-54-00-12-34-AB >/dev/null
assert_eq "MAC kept normalised" "$(vds target show pc1 --json | json_get /dev/stdin 'j["macs"]')" "['52:54:00:12:34:ab']"
out=$(vds target add pc2 --vdisk win --cache ram-overflow --mac 52:54:00:12:34:ab 2>&1) && fail "a second record took pc1's MAC: $out"
grep -q "MAC 52:54:00:12:34:ab belongs to target pc1" <<<"$out" || fail "the refusal does not name pc1: $out"
out=$(vds target add pc2 --vdisk win --cache ram-overflow --mac 52:54:00:12:34 2>&1) && fail "a bad MAC was taken: $out"
grep -q '"52:54:00:12:34" is not a MAC address' <<<"$out" || fail "the bad MAC is not named: $out"
vds target add pc2 --vdisk win --cache device-ram --ram 64M --hostname lab-02 >/dev/null
vds target set pc2 --mac 52:54:00:12:34:cd --mac 52:54:00:12:34:ce >/dev/null
vds target set pc2 --remove-mac 52-54-00-12-34-CE >/dev/null
grep -Eq '^pc2 .* 52:54:00:12:34:cd ' <<<"$(vds target list)" || fail "target list does not show pc2's MAC: $(vds target list)"
grep -q "macs:     52:54:00:12:34:cd" <<<"$(vds target show pc2)" || fail "target show: $(vds target show pc2)"

TFTP_DIR=$E2E_TMP/ipxe
mkdir -p "$TFTP_DIR/sub"
cp "$IPXE" "$TFTP_DIR/undionly.kpxe"
echo "not for TFTP" >"$TFTP_DIR/sub/hidden"
echo "secret" >"$E2E_TMP/secret"
start_api --boot --tftp 127.0.0.1:0 --boot-ipxe "$TFTP_DIR"
# The TFTP line comes after the API's (start_api waits for that one): wait for it too,
# bounded. (A grep that found nothing yet used to end the test silently under set -e.)
port=
for _ in $(seq 100); do
    port=$(grep -Eo 'TFTP on 127\.0\.0\.1:[0-9]+' "$API_LOG" | head -n1 | cut -d: -f2 || true)
    [[ -n $port ]] && break
    sleep 0.1
done
[[ -n $port ]] || fail "the server did not say where TFTP listens within 10 s: $(cat "$API_LOG")"

# As iPXE behind qemu's user network asks: Host 10.0.2.2.
first=$(curl -sS --max-time 30 -H 'Host: 10.0.2.2:8480' "$API_URL/boot/ipxe")
grep -qx 'chain --replace --autofree http://10.0.2.2:8480/boot/target/${net0/mac:hexhyp}' <<<"$first" || fail "first script: $first"
script=$(curl -sS --max-time 30 -H 'Host: 10.0.2.2:8480' "$API_URL/boot/target/52-54-00-12-34-AB")
kernel=$(grep '^kernel ' <<<"$script") || fail "no kernel line: $script"
for want in "kernel http://10.0.2.2:8480/boot/vdisk/win/base/vmlinuz " " vdstream.target=pc1 " " vdstream.server=http://10.0.2.2:8480 " \
    " vdstream.vdisk=win@base " " vdstream.cache=ram-overflow " " vdstream.ram=256M " " vdstream.hostname=pc1 " " vdstream.machine_id="; do
    grep -qF -- "$want" <<<"$kernel" || fail "'$want' missing from: $kernel"
done
grep -qx 'initrd http://10.0.2.2:8480/boot/vdisk/win/base/initrd.img || goto failed' <<<"$script" || fail "initrd line: $script"
script2=$(curl -sS --max-time 30 "$API_URL/boot/target/52:54:00:12:34:cd")
grep -q "vdstream.hostname=lab-02 " <<<"$script2" || fail "pc2's host name: $script2"
grep -q "vdstream.server=$API_URL " <<<"$script2" || fail "the Host curl used names the server: $script2"
log "ok: known MACs get their scripts"

refusal=$(curl -sS --max-time 30 "$API_URL/boot/target/52-54-00-00-00-99")
grep -q "no target record has MAC 52:54:00:00:00:99" <<<"$refusal" || fail "refusal: $refusal"
grep -q "vdstream target add ID --mac 52:54:00:00:00:99" <<<"$refusal" || fail "refusal: $refusal"
grep -q "refused MAC 52:54:00:00:00:99" "$API_LOG" || fail "the log does not name the refused MAC: $(cat "$API_LOG")"
[[ ! -e $STORE/targets/pxe-001.json ]] || fail "refuse added a record"
assert_eq "bad MAC" "$(curl -s -o /dev/null -w '%{http_code}' --max-time 30 "$API_URL/boot/target/xx-54-00-00-00-99")" 400
assert_eq "POST" "$(curl -s -o /dev/null -w '%{http_code}' --max-time 30 -X POST "$API_URL/boot/ipxe")" 405
body=$(curl -sS --max-time 30 -w '\n%{http_code}' "$API_URL/boot/vdisk/win/base/vmlinuz")
assert_eq "no kernel: status" "$(tail -n1 <<<"$body")" 404
grep -q "^vDisk win version base" <<<"$body" || fail "no kernel: $body"
problem=$(curl -sS --max-time 30 "$API_URL/boot/vdisk/win/base/problem")
grep -q "^echo vdstream: vDisk win version base" <<<"$problem" || fail "the problem script does not say it: $problem"
grep -q "asked for vmlinuz of win@base" "$API_LOG" || fail "the log does not name the missing kernel"
# A boot-file override is served as it is, with its length.
mkdir -p "$STORE/boot-override/win/base"
head -c 300000 /dev/urandom >"$STORE/boot-override/win/base/vmlinuz"
echo initrd >"$STORE/boot-override/win/base/initrd.img"
curl -sS --max-time 30 -o "$E2E_TMP/vmlinuz" "$API_URL/boot/vdisk/win/base/vmlinuz" || fail "override not served"
cmp "$STORE/boot-override/win/base/vmlinuz" "$E2E_TMP/vmlinuz" || fail "the kernel came back different"
log "ok: unknown MAC refused and logged, bad input refused, a missing kernel named, an override served"

# TFTP with a real client.
curl -sS --max-time 30 -o "$E2E_TMP/got.kpxe" "tftp://127.0.0.1:$port/undionly.kpxe" || fail "TFTP read failed: $(tail -n5 "$API_LOG")"
cmp "$IPXE" "$E2E_TMP/got.kpxe" || fail "TFTP gave other bytes"
curl -sS --max-time 30 -o "$E2E_TMP/got.0" "tftp://127.0.0.1:$port/undionly.0" || fail "TFTP undionly.0 failed"
cmp "$IPXE" "$E2E_TMP/got.0" || fail "undionly.0 is not undionly.kpxe"
for bad in "../secret" "sub/hidden" "%2e%2e/secret" "nope.kpxe"; do
    if curl -sS --path-as-is --max-time 30 -o "$E2E_TMP/bad" "tftp://127.0.0.1:$port/$bad" 2>"$E2E_TMP/bad.err"; then
        fail "TFTP handed out $bad: $(head -c 100 "$E2E_TMP/bad")"
    fi
done
echo x >"$E2E_TMP/up"
if curl -sS --max-time 30 -T "$E2E_TMP/up" "tftp://127.0.0.1:$port/up" 2>/dev/null; then fail "TFTP took a write"; fi
[[ ! -e $TFTP_DIR/up ]] || fail "the write landed"
grep -q 'TFTP: refused .* the path "../secret"' "$API_LOG" || fail "refused TFTP requests are not logged: $(grep TFTP "$API_LOG")"
server_alive "$API_PID" || fail "the server died"
log "ok: TFTP serves iPXE read-only, nothing outside its folder"

# Auto-add: a server told to copy a template gives an unknown machine a record of its own.
stop_pid "$API_PID" 10
vds target add lab-template --vdisk win --cache ram-overflow --ram 128M --overflow-device /dev/sda2 >/dev/null
start_api --boot --boot-unknown auto-add --boot-template lab-template --boot-id-prefix lab
script=$(curl -sS --max-time 30 "$API_URL/boot/target/52-54-00-00-00-77")
for want in " vdstream.target=lab-001 " " vdstream.hostname=lab-001 " " vdstream.overflow=/dev/sda2 " " vdstream.ram=128M "; do
    grep -qF -- "$want" <<<"$script" || fail "auto-add: '$want' missing from: $script"
done
assert_eq "auto-added record" "$(vds target show lab-001 --json | json_get /dev/stdin '(j["macs"], j["vdisk"], j["cache"])')" "(['52:54:00:00:00:77'], 'win', 'ram-overflow')"
vds audit --json | json_get /dev/stdin '[e["action"] for e in j]' | grep -q "target.auto-add" || fail "auto-add is not audited"
log "ok: auto-add makes a record from the template, audited"
