#!/usr/bin/env bash
# `vdstream --help` and `vdstream serve-image --help` exit 0 and mention the command and
# every serve-image option; `vdstream --help` documents the exit statuses; `server --help`
# shows its export table one export a line; an unknown option exits 2 (usage) with a
# message on stderr. (That every argument has a help text is checked by the unit test
# every_argument_has_help in crates/cli/src/main.rs, which walks clap's command tree.)
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require_vdstream
e2e_init

"$VDSTREAM_BIN" --help >"$E2E_TMP/help.txt" 2>&1 || fail "vdstream --help exited non-zero"
cat "$E2E_TMP/help.txt" >&2
grep -q serve-image "$E2E_TMP/help.txt" || fail "vdstream --help does not mention serve-image"
for line in "^Exit status:" "^  2 usage" "^  3 not found" "^  4 conflict" "^  5 I/O" "^  6 unavailable" '"error": \{"kind"'; do
    grep -Eq "$line" "$E2E_TMP/help.txt" || fail "vdstream --help lacks /$line/"
done

"$VDSTREAM_BIN" server --help >"$E2E_TMP/server.txt" 2>&1 || fail "vdstream server --help exited non-zero"
for export in 'vdisk/NAME ' 'vdisk/NAME@V ' 'maintenance/NAME ' 'target/ID '; do
    grep -Eq "^ *$export" "$E2E_TMP/server.txt" || fail "server --help does not start a line with the export $export: $(cat "$E2E_TMP/server.txt")"
done

"$VDSTREAM_BIN" serve-image --help >"$E2E_TMP/serve.txt" 2>&1 || fail "vdstream serve-image --help exited non-zero"
cat "$E2E_TMP/serve.txt" >&2
for opt in --read-only --direct --socket --listen --name --memory; do
    grep -q -- "$opt" "$E2E_TMP/serve.txt" || fail "serve-image --help does not mention $opt"
done

rc=0
"$VDSTREAM_BIN" serve-image --no-such-option >"$E2E_TMP/bad.out" 2>"$E2E_TMP/bad.err" || rc=$?
((rc == 2)) || fail "an unknown option: status $rc, want 2 (usage)"
[[ -s $E2E_TMP/bad.err ]] || fail "no error message on stderr for an unknown option"
log "ok: help texts and unknown option (exit $rc)"
