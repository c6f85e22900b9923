#!/usr/bin/env bash
# A boot storm: N real guests (VDSTREAM_VM_STORM, default 8) boot at the same time from one
# vDisk through one `vdstream server`, each target with its own `ram-overflow` agent, each
# guest writing 1 MiB with sync before it powers off. Reports each target's boot time and
# guest reads against store reads (the server's GET /api/v1/server), and asserts zero
# failures and that the shared read cache kept the store's reads near one guest's worth.
# bench/boot-storm.sh runs the longer storm.
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
require nbdinfo curl
vm_test_init golden
N=${VDSTREAM_VM_STORM:-8}

start_store_server --http 127.0.0.1:0
API=$(grep -Eo 'http://127\.0\.0\.1:[0-9]+' "$SERVER_LOG" | head -n1)
[[ -n $API ]] || fail "the server did not print its HTTP address: $(cat "$SERVER_LOG")"

start=$SECONDS
vm_storm "$N" vm "$(xuri vdisk/golden)" "vdstest=write vdstest.mb=1" --cache ram-overflow --ram 32M
log "ok: $N guests booted at once, zero failures, in $((SECONDS - start)) s"

curl -sS --max-time 10 "$API/api/v1/server" >"$E2E_TMP/server.json" || fail "GET /api/v1/server failed"
"$PY" - "$E2E_TMP/server.json" "$E2E_TMP/vm.storm.jsonl" "$N" <<'PYEOF' || fail "storm I/O: $(cat "$E2E_TMP/server.json")"
import json, sys
srv = json.load(open(sys.argv[1]))
rows = [json.loads(l) for l in open(sys.argv[2])]
n = int(sys.argv[3])
assert len(rows) == n, rows
io = srv["io"]
guest_reads = sum(r["guest"]["read_bytes"] for r in rows)       # what the guests read
agent_reads = sum(r["from_server_bytes"] for r in rows)          # what the agents asked the server
store_reads = io["store"]["read_bytes"]                          # what the server read from the store
one = max(r["from_server_bytes"] for r in rows)
secs = sorted(r["secs"] for r in rows)
print(f"boot times: min {secs[0]:.1f} s, median {secs[n // 2]:.1f} s, max {secs[-1]:.1f} s")
print(f"guests read {guest_reads >> 10} KiB, the agents read {agent_reads >> 10} KiB from the server "
      f"(server's guest reads: {io['guest']['read_bytes'] >> 10} KiB), the store was read {store_reads >> 10} KiB "
      f"= {store_reads / one:.2f}x one target's reads; read cache: {srv['read_cache']}")
assert io["guest"]["read_bytes"] >= agent_reads, ("the server saw fewer reads than the agents made", io)
assert store_reads > 0
assert store_reads <= 2 * one, f"store reads {store_reads} are not near one target's worth {one}: the read cache did not share"
assert io["store"]["write_bytes"] == 0, ("a standard target wrote to the store", io)
PYEOF
log "ok: the store was read about once for $N guests"
rc=0
stop_server "$SERVER_PID" 15 || rc=$?
assert_eq "server exit status" "$rc" 0
