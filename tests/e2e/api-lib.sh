# shellcheck shell=bash
# tests/e2e/api-lib.sh — helpers for the test-api-*.sh tests (source after lib.sh and
# store-lib.sh).
#
#   start_api [FLAG...]  `vdstream server --http 127.0.0.1:0` on $STORE, its NBD side on the
#                         unix socket $API_NBD_SOCK (extra flags are passed on); sets
#                         API_URL (http://127.0.0.1:PORT), API_PID and API_LOG
#   api METHOD PATH [JSON]
#                         curl the API; prints the body, then a last line with the status
#   server_api_url LOG PID
#                         wait (bounded) until the server logging to LOG (started with
#                         --http 127.0.0.1:0) says where its API listens; sets API_URL

API_URL=
API_PID=
API_LOG=
API_NBD_SOCK=

start_api() {
    local i
    API_LOG=$E2E_TMP/api.log
    API_NBD_SOCK=$E2E_TMP/api-nbd.sock
    "$VDSTREAM_BIN" server --store "$STORE" --socket "$API_NBD_SOCK" --http 127.0.0.1:0 "$@" >"$API_LOG" 2>&1 &
    API_PID=$!
    track_pid "$API_PID"
    E2E_SERVER_LOGS+=("$API_LOG")
    for ((i = 0; i < READY_SECS * 10; i++)); do
        API_URL=$(grep -Eo 'http://127\.0\.0\.1:[0-9]+' "$API_LOG" 2>/dev/null | head -n1 || true)
        [[ -n $API_URL ]] && break
        kill -0 "$API_PID" 2>/dev/null || fail "the API exited at start: $(cat "$API_LOG")"
        sleep 0.1
    done
    [[ -n $API_URL ]] || fail "the API did not say where it listens within ${READY_SECS}s: $(cat "$API_LOG")"
    log "API at $API_URL (pid $API_PID)"
}

api() {
    local method=$1 path=$2 body=${3-}
    if [[ -n $body ]]; then
        curl -sS --max-time 30 -X "$method" -H 'Content-Type: application/json' --data-binary "$body" -w '\n%{http_code}' "$API_URL$path"
    else
        curl -sS --max-time 30 -X "$method" -w '\n%{http_code}' "$API_URL$path"
    fi
}

server_api_url() {
    local log=$1 pid=$2 i
    API_URL=
    for ((i = 0; i < READY_SECS * 10; i++)); do
        API_URL=$(grep -Eo 'http://127\.0\.0\.1:[0-9]+' "$log" 2>/dev/null | head -n1 || true)
        [[ -n $API_URL ]] && return 0
        kill -0 "$pid" 2>/dev/null || fail "the server exited at start: $(cat "$log")"
        sleep 0.1
    done
    fail "the server did not say where its API listens within ${READY_SECS}s: $(cat "$log")"
}
