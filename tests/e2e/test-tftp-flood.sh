#!/usr/bin/env bash
# TFTP (`vdstream server --tftp`) under a flood of read requests that are never
# acknowledged, sent as raw UDP datagrams by a script, as a hostile machine on the boot
# LAN would:
#  1. 64 requests from one address (127.0.0.2, 64 source ports): that address holds a few
#     transfers at most, the rest are refused and logged, and a PXE ROM's request (curl's
#     TFTP client, from 127.0.0.1) is served at once, byte for byte.
#  2. 64 requests from 64 addresses (127.0.1.1-64, one each): they fill the server's
#     transfers; each gives its slot back once its client has not acknowledged for a few
#     seconds, so a PXE ROM that asks again (every 0.5 s, as a ROM retries) is served
#     within 10 s of the flood.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
source "$(dirname "$0")/api-lib.sh"
require curl
require_vdstream
curl --version | grep -qw tftp || skip "this curl has no TFTP"
e2e_init
store_init

TFTP_DIR=$E2E_TMP/ipxe
mkdir -p "$TFTP_DIR"
# Any file will do for the transfer: 100 KiB, the size of undionly.kpxe, 200 blocks.
head -c 102400 /dev/urandom >"$TFTP_DIR/undionly.kpxe"
vds vdisk create win --size 16M >/dev/null
start_api --boot --tftp 127.0.0.1:0 --boot-ipxe "$TFTP_DIR"
port=
for _ in $(seq 100); do
    port=$(grep -Eo 'TFTP on 127\.0\.0\.1:[0-9]+' "$API_LOG" | head -n1 | cut -d: -f2 || true)
    [[ -n $port ]] && break
    sleep 0.1
done
[[ -n $port ]] || fail "the server did not say where TFTP listens within 10 s: $(cat "$API_LOG")"

# flood MODE — 64 read requests (one: from 127.0.0.2; many: from 127.0.1.1..64), never
# acknowledged; the sockets stay open (the server's data goes nowhere) for 60 s at most,
# or until the test ends. Prints "sent" once every request is out.
flood() {
    "$PY" - "$port" "$1" >"$E2E_TMP/flood-$1.out" 2>&1 <<'PY' &
import socket, sys, time
port, mode = int(sys.argv[1]), sys.argv[2]
socks = []
for i in range(64):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(("127.0.0.2" if mode == "one" else "127.0.1.%d" % (i + 1), 0))
    s.sendto(b"\x00\x01undionly.kpxe\x00octet\x00", ("127.0.0.1", port))
    socks.append(s)
print("sent", flush=True)
time.sleep(60)
PY
    FLOOD_PID=$!
    track_pid "$FLOOD_PID"
    for _ in $(seq 100); do
        grep -q sent "$E2E_TMP/flood-$1.out" 2>/dev/null && break
        sleep 0.1
    done
    grep -q sent "$E2E_TMP/flood-$1.out" || fail "the flood script did not send within 10 s: $(cat "$E2E_TMP/flood-$1.out")"
    sleep 0.5 # the server has read the datagrams
}

# rom — one TFTP read as a PXE ROM makes it; status 0 and the file's bytes, or not.
rom() {
    rm -f "$E2E_TMP/got"
    curl -sS --max-time 5 -o "$E2E_TMP/got" "tftp://127.0.0.1:$port/undionly.kpxe" 2>"$E2E_TMP/rom.err" &&
        cmp -s "$TFTP_DIR/undionly.kpxe" "$E2E_TMP/got"
}

# 1. One address floods.
flood one
rom || fail "during a flood from one address, a PXE ROM's request was not served: $(cat "$E2E_TMP/rom.err")"
grep -q "TFTP: refused 127.0.0.2:[0-9]* .*transfers running from this address" "$API_LOG" \
    || fail "the refusals of the flooding address are not logged: $(grep TFTP "$API_LOG" | tail -n 5)"
log "ok: 64 requests from one address: a few held, the rest refused; another machine is served at once"
stop_pid "$FLOOD_PID" 5

# 2. Many addresses flood; wait until the first flood's transfers gave their slots back.
sleep 8
flood many
t0=$SECONDS
served=
for _ in $(seq 40); do
    if rom; then
        served=$((SECONDS - t0))
        break
    fi
    sleep 0.5
done
[[ -n $served ]] || fail "after a flood of 64 unacknowledged requests, a PXE ROM was not served within 20 s: $(cat "$E2E_TMP/rom.err")"
((served <= 10)) || fail "after a flood of 64 unacknowledged requests, a PXE ROM was served only after ${served} s (more than 10 s)"
log "ok: 64 unacknowledged requests from 64 addresses: a PXE ROM served ${served} s after the flood"
server_alive "$API_PID" || fail "the server died"
