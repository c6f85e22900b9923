#!/usr/bin/env bash
# Guessing API tokens is seen and slowed. curl from 127.0.0.2 sends 20 wrong bearer
# tokens: the first ones are 401, then the address is penalized (429 with Retry-After,
# even for a good token, as the NBD handshake penalties close a failing address at
# accept); the server logs the failures with the address, rate-limited (not one line per
# guess), never the token; /metrics counts the failures and the penalized requests; the
# host's own 127.0.0.1 (exempt by default, --handshake-penalty-exempt) is still served.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
source "$(dirname "$0")/api-lib.sh"
require curl
require_vdstream
e2e_init
store_init

vds vdisk create win --size 16M >/dev/null
adm=$(vds token add root --role admin 2>/dev/null)
start_api

# status FROM TOKEN PATH — the HTTP status of a GET from address FROM with TOKEN.
status() {
    curl -sS --max-time 10 --interface "$1" -o "$E2E_TMP/body" -D "$E2E_TMP/head" -w '%{http_code}' \
        -H "Authorization: Bearer $2" "$API_URL$3"
}

codes=()
for i in $(seq 20); do
    codes+=("$(status 127.0.0.2 "vdst_guess${i}AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA" /api/v1/server)")
done
log "answers to 20 wrong tokens: ${codes[*]}"
[[ ${codes[0]} == 401 ]] || fail "the first wrong token was answered ${codes[0]}, not 401"
[[ ${codes[19]} == 429 ]] || fail "an address that sent 20 wrong tokens is not slowed: the 20th was answered ${codes[19]}, not 429 (all: ${codes[*]})"
status 127.0.0.2 "vdst_guessAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA" /api/v1/server >/dev/null
grep -qi '^retry-after: [0-9]' "$E2E_TMP/head" || fail "429 without Retry-After: $(cat "$E2E_TMP/head")"
grep -q 'too many failed authentications' "$E2E_TMP/body" || fail "the 429 does not say why: $(cat "$E2E_TMP/body")"
assert_eq "a good token from the penalized address" "$(status 127.0.0.2 "$adm" /api/v1/server)" 429
assert_eq "a good token from 127.0.0.1 (exempt)" "$(status 127.0.0.1 "$adm" /api/v1/server)" 200
log "ok: 401 for the first wrong tokens, then 429 with Retry-After for the address"

lines=$(grep -c "failed authentication.* from 127.0.0.2" "$API_LOG" || true)
((lines >= 1)) || fail "the server does not log the failed authentications with the address: $(tail -n 5 "$API_LOG")"
((lines <= 5)) || fail "the failed authentications are not rate-limited in the log: $lines lines"
grep -q "vdst_guess" "$API_LOG" && fail "a presented token is in the server log"
metrics=$(curl -sS --max-time 10 -H "Authorization: Bearer $adm" "$API_URL/metrics")
failures=$(awk '$1 == "vdstream_api_auth_failures_total" {print $2}' <<<"$metrics")
penalized=$(awk '$1 == "vdstream_api_auth_penalized_total" {print $2}' <<<"$metrics")
[[ -n $failures ]] && ((failures >= 10)) || fail "/metrics does not count the failed authentications: '$failures'"
[[ -n $penalized ]] && ((penalized >= 2)) || fail "/metrics does not count the penalized requests: '$penalized'"
log "ok: $lines log lines, $failures failures and $penalized penalized requests in /metrics"
