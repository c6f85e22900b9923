#!/usr/bin/env bash
# `vdstream --help` and `vdstream serve-image --help` exit 0 and mention the command and
# every serve-image option; an unknown option exits non-zero with a message on stderr.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require_vdstream
e2e_init

"$VDSTREAM_BIN" --help >"$E2E_TMP/help.txt" 2>&1 || fail "vdstream --help exited non-zero"
cat "$E2E_TMP/help.txt" >&2
grep -q serve-image "$E2E_TMP/help.txt" || fail "vdstream --help does not mention serve-image"

"$VDSTREAM_BIN" serve-image --help >"$E2E_TMP/serve.txt" 2>&1 || fail "vdstream serve-image --help exited non-zero"
cat "$E2E_TMP/serve.txt" >&2
for opt in --read-only --direct --socket --listen --name --memory; do
    grep -q -- "$opt" "$E2E_TMP/serve.txt" || fail "serve-image --help does not mention $opt"
done

rc=0
"$VDSTREAM_BIN" serve-image --no-such-option >"$E2E_TMP/bad.out" 2>"$E2E_TMP/bad.err" || rc=$?
((rc != 0)) || fail "an unknown option was accepted"
[[ -s $E2E_TMP/bad.err ]] || fail "no error message on stderr for an unknown option"
log "ok: help texts and unknown option (exit $rc)"
