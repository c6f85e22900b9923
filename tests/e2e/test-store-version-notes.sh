#!/usr/bin/env bash
# A version's note is text for people under the rules of a target's description: one line
# of at most 1024 characters, no control characters. A note with a newline, an ANSI or OSC
# escape, or 100 KB is refused by `version new` (exit status 2) and by the API (400), with
# a message that says the rule, and no version is made. A note that got into a store
# before (written by hand) is printed by `version list` with its control characters
# escaped, so it cannot rewrite the administrator's terminal.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
source "$(dirname "$0")/api-lib.sh"
require curl
require_vdstream
e2e_init
store_init

make_sparse_image "$E2E_TMP/w.raw" 8
vds vdisk import w "$E2E_TMP/w.raw" >/dev/null

refused_note() { # DESCRIPTION NOTE
    local rc=0
    vds version new w --note "$2" >"$E2E_TMP/out" 2>"$E2E_TMP/err" || rc=$?
    [[ $rc -eq 2 ]] || fail "version new with $1: exit status $rc, want 2; $(cat "$E2E_TMP/err")"
    grep -q "at most 1024 characters of text on one line" "$E2E_TMP/err" || fail "the refusal of $1 does not state the rule: $(cat "$E2E_TMP/err")"
    log "refused: $1"
}
refused_note "a newline" $'patched\nversion 9   production   (forged line)'
refused_note "an OSC escape" $'\e]0;owned\a'
refused_note "an ANSI escape" $'\e[2J\e[Hclean'
refused_note "100 KB" "$(head -c 102400 /dev/zero | tr '\0' 'x')"
assert_eq "versions after the refusals" "$(vds version list w --json | json_get /dev/stdin 'len(j["versions"])')" 0

# The API applies the same rule.
start_api
out=$(api POST /api/v1/vdisks/w/versions '{"note": "a\u001b[2Jb"}')
assert_eq "API status of a note with an escape" "$(tail -n 1 <<<"$out")" 400
grep -q "control character" <<<"$out" || fail "the API's refusal does not say why: $out"
out=$(api POST /api/v1/vdisks/w/versions '{"note": "patched KB5034441"}')
assert_eq "API status of a plain note" "$(tail -n 1 <<<"$out")" 201
stop_pid "$API_PID" 15

# A note written into the store by hand is printed escaped.
"$PY" - "$STORE/vdisks/w/vdisk.json" <<'EOF'
import json, sys
p = sys.argv[1]
m = json.load(open(p))
m["versions"][0]["note"] = "ok\u001b]0;owned\u0007\nforged"
json.dump(m, open(p, "w"), indent=1)
EOF
vds version list w >"$E2E_TMP/list"
if LC_ALL=C grep -q $'\e' "$E2E_TMP/list"; then fail "version list printed an escape character raw"; fi
grep -qF 'ok\u{1b}]0;owned\u{7}\nforged' "$E2E_TMP/list" || fail "version list does not show the note escaped: $(cat "$E2E_TMP/list")"
log "ok"
