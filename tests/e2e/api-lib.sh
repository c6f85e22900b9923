# shellcheck shell=bash
# tests/e2e/api-lib.sh — helpers for the test-api-*.sh tests (source after lib.sh and
# store-lib.sh).
#
#   start_api             serve the HTTP API on $STORE at a free loopback port; sets
#                         API_URL (http://127.0.0.1:PORT) and API_PID
#   api METHOD PATH [JSON]
#                         curl the API; prints the body, then a last line with the status
#   require_server_http   skip unless `vdstream server` has --http (NBD and API in one process)
#   server_api_url LOG PID
#                         wait (bounded) until the server logging to LOG says where its API
#                         listens; sets API_URL
#
# The API is served by `vdstream server --http` when the binary has it, else by the
# vdstream-server example `http-api` (the API alone, no NBD), found next to the binary:
# build it with `cargo build --release -p vdstream-server --example http-api`.

API_URL=
API_PID=

api_command() {
    if "$VDSTREAM_BIN" server --help 2>/dev/null | grep -q -- '--http'; then
        echo "$VDSTREAM_BIN server --store $STORE --http 127.0.0.1:0"
        return
    fi
    local ex
    ex=$(dirname "$VDSTREAM_BIN")/examples/http-api
    [[ -x $ex ]] || skip "no API to test: neither \`vdstream server --http\` nor $ex (cargo build --release -p vdstream-server --example http-api)"
    echo "$ex --store $STORE --http 127.0.0.1:0"
}

start_api() {
    local log=$E2E_TMP/api.log i
    # shellcheck disable=SC2046
    $(api_command) >"$log" 2>&1 &
    API_PID=$!
    track_pid "$API_PID"
    E2E_SERVER_LOGS+=("$log")
    for ((i = 0; i < READY_SECS * 10; i++)); do
        API_URL=$(grep -Eo 'http://127\.0\.0\.1:[0-9]+' "$log" 2>/dev/null | head -n1 || true)
        [[ -n $API_URL ]] && break
        kill -0 "$API_PID" 2>/dev/null || fail "the API exited at start: $(cat "$log")"
        sleep 0.1
    done
    [[ -n $API_URL ]] || fail "the API did not say where it listens within ${READY_SECS}s: $(cat "$log")"
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

require_server_http() {
    "$VDSTREAM_BIN" server --help 2>/dev/null | grep -q -- '--http' ||
        skip "\`vdstream server\` has no --http in this build"
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
