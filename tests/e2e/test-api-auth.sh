#!/usr/bin/env bash
# Who may call the HTTP API. On loopback without TLS and before any token is made, the API
# is open (as the demo and the other tests use it). Then, with tokens (`vdstream token
# add`): a call without one is 401 with `WWW-Authenticate: Bearer`, a read-only token
# trying a promote is 403 naming the role, a revoked token is 401, and none of them changes
# the store; operator and admin tokens do their part; the CLI's --server sends the token
# from VDSTREAM_TOKEN or --token-file; no token ever reaches the server's log.
# Over HTTPS (--tls-certificates, certificates made here with openssl): curl with
# --cacert; an agent's target certificate (SAN URI urn:vdstream:target:pc-01) may report
# status for pc-01 (200) and not for pc-02 (403); a client that stops in the TLS
# handshake is dropped within the 10 s request deadline. A real agent (`target attach
# pc-01 --server https://...`) with only its target certificate reads its record and
# reports its status.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
source "$(dirname "$0")/api-lib.sh"
source "$(dirname "$0")/agent-lib.sh"
require curl
require openssl
require_vdstream
e2e_init
store_init

vds vdisk create win --size 16M >/dev/null
vds version new win >/dev/null
vds target add pc-01 --vdisk win --cache device-ram --ram 8M >/dev/null
vds target add pc-02 --vdisk win --cache server >/dev/null
start_api

# status CURL-ARGS...: the HTTP status of one call.
status() { curl -sS --max-time 30 -o "$E2E_TMP/body" -D "$E2E_TMP/head" -w '%{http_code}' "$@"; }
promote=(-X POST -H 'Content-Type: application/json' --data-binary '{"to":"test"}' "$API_URL/api/v1/vdisks/win/versions/1/promote")
expect() { [[ $1 == "$2" ]] || fail "$3: got '$1', want '$2'"; log "ok: $3"; }
snapshot() { vds version list win --json; vds target list --json; }

# Open until a token exists.
expect "$(status "$API_URL/api/v1/server")" 200 "open API on loopback, no token made"
grep -q 'HTTP API open to local users' "$API_LOG" || fail "the server did not say its API is open: $(cat "$API_LOG")"

ro=$(vds token add dash --role read-only --json | json_get /dev/stdin 'j["token"]')
op=$(vds token add helpdesk --role operator --json | json_get /dev/stdin 'j["token"]')
adm=$(vds token add root --role admin --json | json_get /dev/stdin 'j["token"]')
[[ $ro == vdst_* && ${#ro} -eq 48 ]] || fail "a token is vdst_ and 43 base64url characters: $ro"
grep -q "$ro" "$STORE/api-tokens.json" && fail "the token file holds a token itself, not its hash"
expect "$(stat -c %a "$STORE/api-tokens.json")" 600 "the token file is private"
vds token list | grep -q '^dash  *read-only' || fail "token list: $(vds token list)"
vds token list --json | grep -q vdst_ && fail "token list shows a token"

before=$(snapshot)
expect "$(status "$API_URL/api/v1/server")" 401 "no token, once one exists"
grep -qi '^www-authenticate: Bearer' "$E2E_TMP/head" || fail "401 without WWW-Authenticate: Bearer: $(cat "$E2E_TMP/head")"
grep -q '"what_to_do"' "$E2E_TMP/body" || fail "401 without the error document: $(cat "$E2E_TMP/body")"
expect "$(status "${promote[@]}")" 401 "a promote without a token"
expect "$(status -H "Authorization: Bearer $ro" "${promote[@]}")" 403 "a read-only token trying a promote"
grep -q 'needs role admin' "$E2E_TMP/body" || fail "403 does not name the role: $(cat "$E2E_TMP/body")"
expect "$(status -H "Authorization: Bearer $ro" -X DELETE "$API_URL/api/v1/targets/pc-02")" 403 "a read-only token removing a target"
expect "$(status -H "Authorization: Bearer $op" "${promote[@]}")" 403 "an operator token trying a promote"
expect "$(snapshot)" "$before" "refused calls leave the store as it was"
expect "$(status -H "Authorization: Bearer $ro" "$API_URL/api/v1/targets")" 200 "read-only reads"

# Revoked: refused on the next call, changing nothing.
vds token revoke helpdesk >/dev/null
expect "$(status -H "Authorization: Bearer $op" -X DELETE "$API_URL/api/v1/targets/pc-02")" 401 "a revoked token"
expect "$(snapshot)" "$before" "a revoked token leaves the store as it was"

# The admin does it; the CLI sends the token from the environment or a file.
expect "$(status -H "Authorization: Bearer $adm" "${promote[@]}")" 200 "an admin token promotes"
rc=0; "$VDSTREAM_BIN" target list --server "$API_URL" --json >"$E2E_TMP/denied.json" 2>/dev/null || rc=$?
expect "$rc" 8 "the CLI without a token: exit status 8 (denied)"
expect "$(json_get "$E2E_TMP/denied.json" 'j["error"]["kind"]')" denied "the CLI's JSON error kind without a token"
VDSTREAM_TOKEN=$ro "$VDSTREAM_BIN" target list --server "$API_URL" | grep -q pc-01 || fail "the CLI with VDSTREAM_TOKEN"
printf '%s\n' "$adm" >"$E2E_TMP/admin.token"
"$VDSTREAM_BIN" target remove pc-02 --server "$API_URL" --token-file "$E2E_TMP/admin.token" >/dev/null || fail "the CLI with --token-file"
rc=0; out=$(VDSTREAM_TOKEN=$ro "$VDSTREAM_BIN" target add pc-03 --vdisk win --cache server --server "$API_URL" 2>&1) || rc=$?
expect "$rc" 8 "read-only adding a target: exit status 8 (denied)"
grep -q 'needs role operator' <<<"$out" || fail "the CLI does not say which role is needed: $out"

# HTTPS with a CA, a server certificate and a target's client certificate made here.
pki=$E2E_TMP/pki
mkdir -p "$pki/agent1"
ossl() { openssl "$@" >/dev/null 2>&1 || fail "openssl $*"; }
ossl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days 2 -subj /CN=test-ca \
    -keyout "$pki/ca-key.pem" -out "$pki/ca-cert.pem"
issue() { # NAME SUBJECT-ALT-NAME EKU
    ossl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$1" -keyout "$pki/$1-key.pem" -out "$pki/$1.csr"
    printf 'subjectAltName=%s\nextendedKeyUsage=%s\nbasicConstraints=CA:FALSE\n' "$2" "$3" >"$pki/$1.ext"
    ossl x509 -req -in "$pki/$1.csr" -CA "$pki/ca-cert.pem" -CAkey "$pki/ca-key.pem" -CAcreateserial -days 1 \
        -extfile "$pki/$1.ext" -out "$pki/$1-cert.pem"
}
issue server 'IP:127.0.0.1,DNS:localhost,URI:urn:vdstream:server:pvs1' serverAuth
issue agent1 'URI:urn:vdstream:target:pc-01' clientAuth
cp "$pki/ca-cert.pem" "$pki/agent1/ca-cert.pem"
cp "$pki/agent1-cert.pem" "$pki/agent1/client-cert.pem"
cp "$pki/agent1-key.pem" "$pki/agent1/client-key.pem"
tls_log=$E2E_TMP/tls.log
"$VDSTREAM_BIN" server --store "$STORE" --socket "$E2E_TMP/tls-nbd.sock" --http 127.0.0.1:0 --tls-certificates "$pki" >"$tls_log" 2>&1 &
tls_pid=$!
track_pid "$tls_pid"
E2E_SERVER_LOGS+=("$tls_log")
url=
for ((i = 0; i < READY_SECS * 10; i++)); do
    url=$(grep -Eo 'https://127\.0\.0\.1:[0-9]+' "$tls_log" | head -n1 || true)
    [[ -n $url ]] && break
    kill -0 "$tls_pid" 2>/dev/null || fail "the TLS server exited: $(cat "$tls_log")"
    sleep 0.1
done
[[ -n $url ]] || fail "the TLS server did not say where its API listens: $(cat "$tls_log")"
log "HTTPS API at $url"
report='{"target":"pc-01","pid":4242,"state":"running","server":{"endpoint":"nbd://127.0.0.1/","connected":true,"retries":0}}'
as_agent=(--cacert "$pki/ca-cert.pem" --cert "$pki/agent1-cert.pem" --key "$pki/agent1-key.pem")
put_report() { status "$@" -X PUT -H 'Content-Type: application/json' --data-binary "$report"; }
expect "$(status --cacert "$pki/ca-cert.pem" "$url/api/v1/server")" 401 "https without a token or certificate"
expect "$(status --cacert "$pki/ca-cert.pem" -H "Authorization: Bearer $ro" "$url/api/v1/server")" 200 "https with a token"
expect "$(put_report "${as_agent[@]}" "$url/api/v1/targets/pc-01/agent")" 200 "an agent reports for its own target"
expect "$(put_report "${as_agent[@]}" "$url/api/v1/targets/pc-02/agent")" 403 "an agent reports for another target"
grep -q 'target:pc-01' "$E2E_TMP/body" || fail "the 403 does not name the certificate's identity: $(cat "$E2E_TMP/body")"
expect "$(status "${as_agent[@]}" "$url/api/v1/targets/pc-01")" 200 "an agent reads its own record"
expect "$(status "${as_agent[@]}" -X DELETE "$url/api/v1/targets/pc-01")" 403 "an agent removes its record"
json_get "$E2E_TMP/body" 'j["error"]' >/dev/null || fail "403 without the error document"
curl -sS --max-time 5 "${url/https/http}/api/v1/server" >/dev/null 2>&1 && fail "plain http answered on the https port"
# The agent's client (the CLI's --server) over https with the certificate directory.
VDSTREAM_TOKEN=$ro "$VDSTREAM_BIN" target show pc-01 --server "$url" --tls-certificates "$pki/agent1" | grep -q pc-01 \
    || fail "the CLI over https: $(VDSTREAM_TOKEN=$ro "$VDSTREAM_BIN" target show pc-01 --server "$url" --tls-certificates "$pki/agent1" 2>&1)"
"$VDSTREAM_BIN" target show pc-01 --server "$url" --tls-certificates "$pki/agent1" | grep -q pc-01 \
    || fail "the CLI over https with the target's certificate only"
"$VDSTREAM_BIN" target list --server "$url" --tls-certificates "$pki/agent1" >/dev/null 2>&1 \
    && fail "a target's certificate listed every target"

# A real agent over https with only its target certificate: record read, status reported.
VDSTREAM_TLS_CERTIFICATES=$pki/agent1 start_agent pc-01 --server "$url"
ok=
for ((i = 0; i < 100; i++)); do
    status --cacert "$pki/ca-cert.pem" -H "Authorization: Bearer $ro" "$url/api/v1/targets/pc-01" >/dev/null
    if [[ $(json_get "$E2E_TMP/body" 'j.get("agent", {}).get("pid")') == "$AGENT_PID" ]]; then
        ok=1
        break
    fi
    sleep 0.2
done
[[ -n $ok ]] || fail "the agent's report over https did not arrive: $(cat "$E2E_TMP/body"); $(tail -5 "$AGENT_LOG")"
log "ok: the agent of pc-01 reported over https with its target certificate"
stop_server "$AGENT_PID" 15 || fail "the agent did not stop cleanly"

# A client that stops in the TLS handshake is dropped within the request deadline (10 s).
port=${url##*:}
started=$SECONDS
exec 3<>"/dev/tcp/127.0.0.1/$port"
printf '\x16\x03\x01' >&3
timeout 30 cat <&3 >/dev/null || true
exec 3<&-
took=$((SECONDS - started))
((took <= 15)) || fail "a stalled TLS handshake held its connection ${took}s"
grep -q 'TLS handshake was not over within 10 s' "$tls_log" || fail "the drop is not logged: $(tail -5 "$tls_log")"
log "a stalled TLS handshake was dropped after ${took}s"

# No token in any log line of either server.
for t in "$ro" "$op" "$adm"; do
    grep -qF -- "${t#vdst_}" "$API_LOG" "$tls_log" && fail "a token is in the server log"
done
log "PASS"
