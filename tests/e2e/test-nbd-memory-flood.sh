#!/usr/bin/env bash
# No client may hoard the server's memory: 24 connections each send 40 READs of 32 MiB and
# never read the replies (bench/nbd-flood.py). The server's RSS grows by less than 256 MiB
# (the flood asks for 30 GiB), a normal client (libnbd, default settings) on the same
# export keeps reading with no error while the flood goes on, and the server logs that its
# request memory (--max-request-memory, default 128M) is full.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require_python_nbd
require_vdstream
e2e_init

start_server --memory 1G --name vdstream
"$PY" "$E2E_DIR/../../bench/nbd-flood.py" "$SOCK" vdstream "$SERVER_PID" --conns 24 --reads 40 --size 32M --seconds 8 \
    >"$E2E_TMP/flood.json" 2>"$E2E_TMP/flood.err" || fail "the flood tool failed: $(cat "$E2E_TMP/flood.err")"
log "flood: $(cat "$E2E_TMP/flood.json")"
growth=$(json_get "$E2E_TMP/flood.json" 'j["growth"]')
reads=$(json_get "$E2E_TMP/flood.json" 'j["normal_reads"]')
errors=$(json_get "$E2E_TMP/flood.json" 'j["normal_errors"]')
((growth < 256 << 20)) || fail "the server grew by $((growth >> 20)) MiB under the flood (bound: 256 MiB)"
assert_eq "errors of the normal client during the flood" "$errors" 0
((reads >= 50)) || fail "the normal client completed only $reads reads in 8 s of flood"
assert_eq "the server died under the flood" "$(json_get "$E2E_TMP/flood.json" 'j["server_died"]')" False
server_alive || fail "the server died under the flood"
grep -q "request memory is full" "$SERVER_LOG" || fail "the server's log does not say its request memory filled: $(tail -n 5 "$SERVER_LOG")"
log "ok: grew $((growth >> 20)) MiB; the normal client read $reads times"
