# shellcheck shell=bash
# tests/e2e/agent-lib.sh — sourced by the test-agent-* scripts, after lib.sh:
#   start_agent ID ARGS...   `vdstream target attach ID ARGS...` with its run and cache
#                            directories in the scratch dir; waits (bounded) until its
#                            socket answers NBD; sets AGENT_PID, AGENT_LOG, AGENT_SOCK and
#                            points URI at the agent.

export VDSTREAM_RUN_DIR VDSTREAM_CACHE_DIR
AGENT_PID='' AGENT_LOG='' AGENT_SOCK=''

agent_env() {
    VDSTREAM_RUN_DIR=$E2E_TMP/run
    VDSTREAM_CACHE_DIR=$E2E_TMP/cache
}

start_agent() {
    local id=$1; shift
    agent_env
    AGENT_SOCK=$VDSTREAM_RUN_DIR/$id.sock
    AGENT_LOG=$E2E_TMP/agent-$id.log
    if [[ ${VDSTREAM_E2E_TLS:-0} == 1 ]]; then
        set -- "$@" --tls-certificates "$PKI_DIR/client"
    fi
    log "starting: vdstream target attach $id $*"
    "$VDSTREAM_BIN" target attach "$id" "$@" >"$AGENT_LOG" 2>&1 </dev/null &
    AGENT_PID=$!
    E2E_PIDS+=("$AGENT_PID")
    E2E_SERVER_PIDS+=("$AGENT_PID")
    E2E_SERVER_LOGS+=("$AGENT_LOG")
    URI="nbd+unix:///?socket=$AGENT_SOCK"
    wait_ready "$AGENT_PID" "$URI"
}

# agent_status_get ID EXPR — python EXPR over the agent's status JSON `j`. `target status`
# still prints the status of an agent that stopped or lost its cache, and exits 6
# (unavailable) for it; the caller asserts the state.
agent_status_get() {
    local id=$1 expr=$2 rc=0
    "$VDSTREAM_BIN" target status "$id" --json >"$E2E_TMP/status.json" || rc=$?
    ((rc == 0 || rc == 6)) || fail "target status $id failed (exit $rc)"
    json_get "$E2E_TMP/status.json" "$expr"
}
