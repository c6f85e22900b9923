#!/usr/bin/env bash
# The log for machines: with VDSTREAM_LOG_FORMAT=json every line `vdstream server` writes
# on stderr is one JSON object with timestamp, level, target and message, and the lines a
# refused export and a drain write are among them; under systemd (JOURNAL_STREAM set) the
# text lines carry no time, which the journal adds; an unknown format is named in a
# warning and the log stays text.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
# shellcheck source=store-lib.sh
source "$E2E_DIR/store-lib.sh"
require nbdinfo python3
require_vdstream
e2e_init
store_init
vds vdisk create w --size 1M >/dev/null
sock=$E2E_TMP/server.sock

# run_server LOG ENV... — a server on $sock with ENV, asked for a missing export, stopped.
run_server() {
    local logf=$1 pid
    shift
    env "$@" "$VDSTREAM_BIN" server --store "$STORE" --socket "$sock" 2>"$logf" >/dev/null </dev/null &
    pid=$!
    track_pid "$pid"
    wait_ready "$pid" "nbd+unix:///vdisk/w?socket=$sock"
    ! nbdinfo "nbd+unix:///vdisk/nosuch?socket=$sock" >/dev/null 2>&1 || fail "vdisk/nosuch was served"
    stop_server "$pid" 10 || true
    rm -f "$sock"
}

run_server "$E2E_TMP/json.log" VDSTREAM_LOG_FORMAT=json
python3 - "$E2E_TMP/json.log" <<'PY' || fail "the JSON log is not one object a line with timestamp, level, target and message (above)"
import json, sys
lines = open(sys.argv[1]).read().splitlines()
assert lines, "no log lines"
events = []
for n, line in enumerate(lines, 1):
    try:
        e = json.loads(line)
    except ValueError:
        sys.exit(f"line {n} is not JSON: {line!r}")
    for key in ("timestamp", "level", "target", "message"):
        if key not in e:
            sys.exit(f"line {n} has no {key}: {line!r}")
    events.append(e)
messages = " | ".join(e["message"] for e in events)
if not any("nosuch" in e["message"] for e in events):
    sys.exit(f"no line names the refused export vdisk/nosuch: {messages}")
if not any("drain" in e["message"] for e in events):
    sys.exit(f"no line tells of the drain: {messages}")
print(f"{len(events)} JSON lines")
PY
log "ok: JSON lines ($(wc -l <"$E2E_TMP/json.log") of them), the refusal and the drain among them"

run_server "$E2E_TMP/journal.log" JOURNAL_STREAM=8:12345
grep -q "drain" "$E2E_TMP/journal.log" || fail "the journal log has no drain line: $(cat "$E2E_TMP/journal.log")"
! grep -qE '^[0-9]{4}-[0-9]{2}-[0-9]{2}T' "$E2E_TMP/journal.log" || fail "under systemd the lines carry a time: $(head -3 "$E2E_TMP/journal.log")"
grep -qE '^ *INFO ' "$E2E_TMP/journal.log" || fail "under systemd the lines do not start with their level: $(head -3 "$E2E_TMP/journal.log")"
log "ok: under systemd, text lines without the time"

run_server "$E2E_TMP/bad.log" VDSTREAM_LOG_FORMAT=xml
grep -q 'VDSTREAM_LOG_FORMAT="xml" is not text, json or journal' "$E2E_TMP/bad.log" || fail "an unknown format is not named: $(head -3 "$E2E_TMP/bad.log")"
grep -qE '^[0-9]{4}-[0-9]{2}-[0-9]{2}T.* INFO ' "$E2E_TMP/bad.log" || fail "an unknown format does not fall back to text: $(head -3 "$E2E_TMP/bad.log")"
log "ok: an unknown format is named and the log stays text"
