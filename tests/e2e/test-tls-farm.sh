#!/usr/bin/env bash
# A farm secured end to end, set up the way docs/SECURITY.md ("Securing a farm, step by
# step") tells a newcomer: `pki init`, the server's certificate, `vdstream server --tls
# require` on 127.0.0.1 with the HTTP API over HTTPS, targets A and B added with
# `--issue-cert`, an admin certificate and API tokens. Then, with real clients:
# - A's agent attaches to target/A over TLS with A's certificate; qemu-io and fio write and
#   read back through it;
# - a plaintext nbdinfo is told the server requires TLS, and the same nbdinfo over nbds://
#   with a certificate works;
# - A's certificate asking for target/B and for maintenance/w is refused by policy, naming
#   the rule, and audit.log has a line for each; alice's admin certificate opens
#   maintenance/w;
# - the API: no token 401, a read-only token's promote 403, a revoked token 401, an
#   operator-less DELETE 401: none of them changes the store (`vdstream vdisk info`,
#   `target list`); the admin token's promote then works;
# - `pki revoke target:A --crl-out SERVERDIR`: A's next connection is refused, and its open
#   agent session is closed within the stated bound (5 s checks, see docs/SERVER.md);
#   alice still gets in.
# This test makes its own farm's certificates: lib.sh's blanket TLS mode stays off.
export VDSTREAM_E2E_TLS=0
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
# shellcheck source=server-lib.sh
source "$E2E_DIR/server-lib.sh"
# shellcheck source=agent-lib.sh
source "$E2E_DIR/agent-lib.sh"
# shellcheck source=fio-verify.sh
source "$E2E_DIR/fio-verify.sh"
require nbdinfo qemu-io fio curl
require_vdstream
e2e_init
store_init

# How long an open session of a revoked certificate may live on: the server checks
# ca-crl.pem every 5 s; the stats file is written every second; slack for a busy machine.
REVOKE_BOUND_SECS=${VDSTREAM_E2E_REVOKE_SECS:-10}

export VDSTREAM_CA=$E2E_TMP/ca
SRV_TLS=$E2E_TMP/server-tls
A_TLS=$E2E_TMP/A-tls
B_TLS=$E2E_TMP/B-tls
ADM_TLS=$E2E_TMP/alice-tls
STATS=$E2E_TMP/stats.json
vd() { "$VDSTREAM_BIN" "$@"; }

# --- the walkthrough: CA, the server's certificate, a vDisk, targets with certificates
golden_vdisk w 32                       # version 1, in production
vd pki init --farm e2e >/dev/null || fail "pki init failed"
vd pki issue server store-a --out "$SRV_TLS" >/dev/null || fail "pki issue server failed"
vds target add A --vdisk w --cache server --issue-cert "$A_TLS" >/dev/null || fail "target add A --issue-cert failed"
vds target add B --vdisk w --cache server --issue-cert "$B_TLS" >/dev/null || fail "target add B --issue-cert failed"
vd pki issue admin alice --out "$ADM_TLS" >/dev/null || fail "pki issue admin failed"
for f in "$A_TLS"/{ca-cert,client-cert,client-key}.pem "$SRV_TLS"/{ca-cert,server-cert,server-key}.pem; do
    [[ -s $f ]] || fail "$f was not written"
done
# A maintenance version to be promoted (or not) later.
v2=$(vds version new w --json | json_get /dev/stdin 'j["version"]["number"]')

# --- API tokens (the token itself is printed once: the vdst_... word of the output)
token_of() { grep -Eo 'vdst_[A-Za-z0-9_-]+' | head -n1; }
TOK_RO=$(vds token add viewer --role read-only | token_of)
TOK_ADMIN=$(vds token add boss --role admin | token_of)
TOK_GONE=$(vds token add leaver --role admin | token_of)
[[ -n $TOK_RO && -n $TOK_ADMIN && -n $TOK_GONE ]] || fail "vdstream token add printed no token"

# --- the server: NBD over TLS only, on 127.0.0.1, and the API over HTTPS
free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
PORT=
for attempt in 1 2 3; do
    PORT=$(free_port)
    SERVER_LOG=$E2E_TMP/server-$attempt.log
    log "starting: vdstream server --listen 127.0.0.1:$PORT --http 127.0.0.1:0 --tls require --tls-certificates $SRV_TLS"
    # The binary itself, not the vd function: `vd … &` would put a subshell between, and
    # stopping $! would leave the server running after the test.
    "$VDSTREAM_BIN" server --store "$STORE" --listen "127.0.0.1:$PORT" --http 127.0.0.1:0 \
        --tls require --tls-certificates "$SRV_TLS" --stats-file "$STATS" >"$SERVER_LOG" 2>&1 </dev/null &
    SERVER_PID=$!
    E2E_PIDS+=("$SERVER_PID") E2E_SERVER_PIDS+=("$SERVER_PID") E2E_SERVER_LOGS+=("$SERVER_LOG")
    up=0
    for ((i = 0; i < READY_SECS * 10; i++)); do
        kill -0 "$SERVER_PID" 2>/dev/null || break
        if timeout 2 bash -c "exec 3<>/dev/tcp/127.0.0.1/$PORT" 2>/dev/null && grep -Eq 'https://127\.0\.0\.1:[0-9]+' "$SERVER_LOG"; then
            up=1
            break
        fi
        sleep 0.1
    done
    ((up)) && break
    kill -0 "$SERVER_PID" 2>/dev/null && fail "the server did not listen on 127.0.0.1:$PORT within ${READY_SECS}s"
    grep -q 'in use' "$SERVER_LOG" || fail "the server exited at start: $(cat "$SERVER_LOG")"
    log "port $PORT was taken meanwhile; again"
done
((up)) || fail "no free port after 3 attempts"
API=$(grep -Eo 'https://127\.0\.0\.1:[0-9]+' "$SERVER_LOG" | head -n1)
log "server pid $SERVER_PID: NBD on 127.0.0.1:$PORT, API at $API"

nbds() { printf 'nbds://127.0.0.1:%s/%s?tls-certificates=%s' "$PORT" "$1" "$2"; }

# --- a plaintext client is told TLS is required; over TLS the same client works
if out=$(timeout 20 nbdinfo --size "nbd://127.0.0.1:$PORT/vdisk/w" 2>&1); then
    fail "a plaintext nbdinfo was served by a --tls require server: $out"
fi
[[ $out == *"requires TLS"* ]] || fail "plaintext nbdinfo: no TLS-required message: $out"
log "ok: plaintext refused: $out"
size=$(timeout 20 nbdinfo --size "$(nbds vdisk/w "$A_TLS")") || fail "nbdinfo over TLS with A's certificate failed"
assert_eq "size of vdisk/w over TLS" "$size" $((32 << 20))

# --- A's agent, attached over TLS with A's certificate
start_agent A --server "nbds://127.0.0.1:$PORT/target/A" --tls-certificates "$A_TLS" --cache server
uri_a=$URI pid_a=$AGENT_PID
qemu-io -f raw -c 'write -P 0x3c 1M 4M' "$uri_a" >/dev/null || fail "qemu-io write through A's agent failed"
qemu-io -f raw -c 'read -P 0x3c 1M 4M' "$uri_a" >/dev/null || fail "qemu-io read-back through A's agent differs"
URI=$uri_a run_fio_verify agent-A --rw=randrw --rwmixwrite=50 --bs=4k --offset=8m --size=16m --iodepth=8 --number_ios=3000
qemu-io -f raw -c 'read -P 0x3c 1M 4M' "$uri_a" >/dev/null || fail "A's first writes are gone after fio"
sessions_of() { json_get "$STATS" "sum(1 for s in j['sessions'] if s.get('target') == '$1')"; }
sleep 1.2
assert_eq "target/A sessions on the server" "$(sessions_of A)" 1
log "ok: A's agent streams over TLS; its writes read back"

# --- A's certificate asking for target/B and for maintenance/w: refused by policy
# libnbd shows the server's message (the rule) only in its debug output.
refused() {   # EXPORT CERTDIR RULE
    local out msg
    if out=$(LIBNBD_DEBUG=1 timeout 20 nbdinfo --size "$(nbds "$1" "$2")" 2>&1); then
        fail "${2##*/} opened $1: $out"
    fi
    [[ $out == *"server policy prevents"* ]] || fail "${2##*/} asking for $1: not NBD_REP_ERR_POLICY: $out"
    msg=$(grep -o 'server error message: .*' <<<"$out" | head -n1)
    [[ $msg == *"rule $3:"* ]] || fail "${2##*/} asking for $1: the refusal does not name rule $3: $out"
    log "ok: ${2##*/} refused $1: ${msg#server error message: }"
}
refused target/B "$A_TLS" target-own-exports
refused maintenance/w "$A_TLS" maintenance-needs-admin
"$PY" - "$STORE/audit.log" <<'PYEOF' || fail "audit.log lacks the refusals: $(tail -n 5 "$STORE/audit.log")"
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
refused = [(e["details"]["identity"], e["details"]["export"], e["details"]["rule"]) for e in lines if e["action"] == "nbd.open.refused"]
for want in (("target:A", "target/B", "target-own-exports"), ("target:A", "maintenance/w", "maintenance-needs-admin")):
    assert want in refused, (want, refused)
print("audit:", refused)
PYEOF
log "ok: audit.log has a line for each refusal"

# --- an administrator's certificate opens maintenance/w (and may write it)
size=$(timeout 20 nbdinfo --size "$(nbds maintenance/w "$ADM_TLS")") || fail "alice could not open maintenance/w"
assert_eq "size of maintenance/w for alice" "$size" $((32 << 20))
log "ok: alice (admin) opens maintenance/w"

# --- the API: refusals change nothing
api_call() {   # TOKEN METHOD PATH [JSON] — prints the HTTP status
    local tok=$1 method=$2 path=$3 body=${4-} args
    args=(-sS --max-time 30 --cacert "$SRV_TLS/ca-cert.pem" -o "$E2E_TMP/api.body" -w '%{http_code}' -X "$method")
    [[ -n $tok ]] && args+=(-H "Authorization: Bearer $tok")
    [[ -n $body ]] && args+=(-H 'Content-Type: application/json' --data-binary "$body")
    curl "${args[@]}" "$API$path"
}
state() { vds vdisk info w --json | json_get /dev/stdin '[(v["number"], v.get("access"), v.get("promoted")) for v in j["meta"]["versions"]]'; vds target list --json; }
before=$(state)
assert_eq "GET without a token" "$(api_call '' GET /api/v1/vdisks)" 401
assert_eq "GET with the read-only token" "$(api_call "$TOK_RO" GET /api/v1/vdisks)" 200
assert_eq "promote without a token" "$(api_call '' POST "/api/v1/vdisks/w/versions/$v2/promote" '{"to":"production"}')" 401
assert_eq "promote with the read-only token" "$(api_call "$TOK_RO" POST "/api/v1/vdisks/w/versions/$v2/promote" '{"to":"production"}')" 403
grep -qi 'admin' "$E2E_TMP/api.body" || fail "the 403 does not name the role needed: $(cat "$E2E_TMP/api.body")"
assert_eq "DELETE a target without a token" "$(api_call '' DELETE /api/v1/targets/B)" 401
vds token revoke leaver >/dev/null || fail "token revoke failed"
assert_eq "promote with a revoked token" "$(api_call "$TOK_GONE" POST "/api/v1/vdisks/w/versions/$v2/promote" '{"to":"production"}')" 401
assert_eq "the store after the refused calls" "$(state)" "$before"
! grep -qF -e "$TOK_RO" -e "$TOK_GONE" -e "$TOK_ADMIN" "$SERVER_LOG" "$STORE/audit.log" || fail "a token was written to a log"
assert_eq "promote with the admin token" "$(api_call "$TOK_ADMIN" POST "/api/v1/vdisks/w/versions/$v2/promote" '{"to":"test"}')" 200
[[ $(state) != "$before" ]] || fail "the admin token's promote changed nothing"
log "ok: API 401/403 change nothing; the admin token works"

# --- revocation: A's next connection is refused, its open session closed within the bound
timeout 20 nbdinfo --size "$(nbds vdisk/w "$A_TLS")" >/dev/null || fail "A's certificate no longer works before the revocation"
vd pki revoke target:A --crl-out "$SRV_TLS" >/dev/null || fail "pki revoke target:A failed"
[[ -s $SRV_TLS/ca-crl.pem ]] || fail "pki revoke --crl-out wrote no ca-crl.pem"
t0=$SECONDS
if out=$(timeout 20 nbdinfo --size "$(nbds vdisk/w "$A_TLS")" 2>&1); then
    fail "A's revoked certificate still opens vdisk/w: $out"
fi
log "ok: A's next connection refused: $out"
closed=0
while ((SECONDS - t0 <= REVOKE_BOUND_SECS)); do
    if [[ $(sessions_of A) == 0 ]]; then closed=1; break; fi
    sleep 0.2
done
((closed)) || fail "A's open session outlived its revocation by more than ${REVOKE_BOUND_SECS}s"
log "ok: A's open session closed $((SECONDS - t0))s after the revocation"
sleep 1.5
assert_eq "target/A sessions after the revocation (the agent cannot come back)" "$(sessions_of A)" 0
size=$(timeout 20 nbdinfo --size "$(nbds vdisk/w "$ADM_TLS")") || fail "alice's certificate stopped working after A's revocation"
assert_eq "size of vdisk/w for alice after the CRL" "$size" $((32 << 20))
log "ok: a farm secured end to end"
