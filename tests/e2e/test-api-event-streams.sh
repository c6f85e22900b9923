#!/usr/bin/env bash
# One credential cannot hold every event stream (GET /api/v1/events): a read-only token
# opens as many as the server keeps (64 curl -N streams); only its share is let in, the
# rest are 429 naming the token and what to do, and the administrator's console (an admin
# token) still gets its stream. Closing one of the token's streams gives its place back.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
source "$(dirname "$0")/api-lib.sh"
require curl
require_vdstream
e2e_init
store_init

vds vdisk create win --size 16M >/dev/null
ro=$(vds token add dash --role read-only 2>/dev/null)
adm=$(vds token add root --role admin 2>/dev/null)
start_api

# open_stream TOKEN N — curl -N GET /api/v1/events in the background; its status line and
# head go to $E2E_TMP/stream-N.head, its events to stream-N.body.
pids=()
open_stream() {
    curl -sS -N --max-time 120 -D "$E2E_TMP/stream-$2.head" -o "$E2E_TMP/stream-$2.body" \
        -H "Authorization: Bearer $1" "$API_URL/api/v1/events" 2>/dev/null &
    pids[$2]=$!
    track_pid "${pids[$2]}"
}
# answered N — the stream's status once its head arrived (bounded wait), or "none".
answered() {
    local i
    for ((i = 0; i < 100; i++)); do
        if grep -q '^HTTP/' "$E2E_TMP/stream-$1.head" 2>/dev/null && grep -q $'^\r$' "$E2E_TMP/stream-$1.head"; then
            awk 'NR == 1 {print $2}' "$E2E_TMP/stream-$1.head"
            return
        fi
        sleep 0.1
    done
    echo none
}

for n in $(seq 64); do
    open_stream "$ro" "$n"
done
ok=0 busy=0
for n in $(seq 64); do
    case $(answered "$n") in
    200) ok=$((ok + 1)) ;;
    429) busy=$((busy + 1)) ;;
    *) fail "stream $n of the read-only token got no answer within 10 s" ;;
    esac
done
log "the read-only token's 64 streams: $ok open, $busy refused"
open_stream "$adm" 100
assert_eq "the administrator's stream while a read-only token holds what it may" "$(answered 100)" 200
((ok >= 1 && ok <= 16)) || fail "one token holds $ok event streams"
((busy == 64 - ok)) || fail "$busy refused, $ok open, of 64"
refused=$(grep -l '^HTTP/1.1 429' "$E2E_TMP"/stream-*.head | head -n1)
body=${refused%.head}.body
grep -q 'dash' "$body" && grep -q 'what_to_do' "$body" || fail "the 429 does not name the token and what to do: $(cat "$body")"
log "ok: the token got $ok streams, the admin got one: $(head -c 200 "$body")"

# A closed stream of the token gives its place back.
for n in $(seq 64); do
    if [[ $(awk 'NR == 1 {print $2}' "$E2E_TMP/stream-$n.head") == 200 ]]; then
        stop_pid "${pids[$n]}" 5
        break
    fi
done
back=
for i in $(seq 20); do
    open_stream "$ro" $((200 + i))
    if [[ $(answered $((200 + i))) == 200 ]]; then
        back=1
        break
    fi
    sleep 0.5
done
[[ -n $back ]] || fail "the place of a closed stream did not come back within 10 s"
log "ok: a closed stream gives its place back"
