#!/usr/bin/env bash
# A real Linux guest boots from a streamed vDisk: the golden image (scripts/make-golden-image)
# is imported into a store, `vdstream server` serves it, an agent with `ram-overflow` offers
# it on its socket, and qemu boots it (-drive file=nbd+unix:///?socket=AGENT_SOCK,if=virtio).
# The guest checks its root is writable, writes 8 MiB with sync, prints its markers on the
# serial console and powers off. The agent's status shows the guest's writes landed in its
# cache and none reached the server; the vDisk still serves the golden image's bytes.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=server-lib.sh
source "$E2E_DIR/server-lib.sh"
# shellcheck source=agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
# shellcheck source=vm-lib.sh
source "$E2E_DIR/vm-lib.sh"
require nbdinfo qemu-img
vm_test_init golden

start_store_server
start_agent vm1 --server "$(xuri vdisk/golden)" --cache ram-overflow --ram 64M
boot_vm vm1 "$URI" "vdstest=write vdstest.tag=first vdstest.mb=8"
serial_has vm1 '^VDSTEST RW ok' || fail "the guest's root was not writable"
serial_has vm1 '^VDSTEST WROTE first mb=8' || fail "the guest did not write its files"
! serial_has vm1 '^VDSTEST SEES' || fail "a fresh golden image already held test files"
log "ok: booted in $(vm_secs vm1) s (init at guest uptime $(booted_uptime vm1) s)"

sleep 1.5 # the agent rewrites its status file every second
"$VDSTREAM_BIN" target status vm1 --json >"$E2E_TMP/status.json" || fail "target status vm1 failed"
"$PY" - "$E2E_TMP/status.json" <<'PYEOF' || fail "agent status after the boot: $(cat "$E2E_TMP/status.json")"
import json, sys
j = json.load(open(sys.argv[1]))
g, s, c = j["guest"], j["server"], j["cache"]
assert j["vdisk"]["description"].startswith("vdisk/golden@base"), j["vdisk"]
assert g["read_bytes"] > 0 and g["write_bytes"] >= 8 << 20, g
assert s["write_bytes"] == 0, ("a guest write reached the server", s)
assert c["type"] == "ram-overflow" and c["ram_bytes"] >= 8 << 20, c
print(f"guest read {g['read_bytes'] >> 10} KiB, wrote {g['write_bytes'] >> 10} KiB; "
      f"from the server {s['read_bytes'] >> 10} KiB; cache holds {c['ram_bytes'] >> 10} KiB in RAM")
PYEOF
stop_server "$AGENT_PID" 15 || fail "the agent did not stop cleanly"

qemu-img compare -q -f raw -F raw "$GOLDEN/golden.img" "$(xuri vdisk/golden)" ||
    fail "the vDisk no longer serves the golden image's bytes"
log "ok: the vDisk is unchanged"
rc=0
stop_server "$SERVER_PID" 15 || rc=$?
assert_eq "server exit status" "$rc" 0
