#!/usr/bin/env bash
# The man pages and shell completion, as the Debian package installs them:
# - `man` shows each page (`vdstream man --out DIR`) with a NAME line that says what
#   vdstream is once ("vdstream - Stream one golden disk image..."), and the Examples and
#   Exit status blocks of `--help` line for line as written, in sections of their own;
# - bash completion (`vdstream completions bash`) offers the cache types after --cache
#   and the stages after `version promote --to`, not file names; and the vDisk names and
#   target ids of the store ($VDSTREAM_STORE) where a command takes one, nothing (and no
#   error) where the store cannot be read;
# - a mistyped --cache is refused (status 2) naming the type it resembles.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
require man
require_vdstream
e2e_init

"$VDSTREAM_BIN" man --out "$E2E_TMP/man1" >/dev/null || fail "vdstream man --out failed"
# render PAGE — the page as man prints it to a file: no pager, wide enough for every line.
render() { MANWIDTH=200 MAN_KEEP_FORMATTING=0 man -P cat -l "$E2E_TMP/man1/$1" 2>/dev/null | col -bx; }
render vdstream.1 >"$E2E_TMP/vdstream.txt"
[[ -s $E2E_TMP/vdstream.txt ]] || fail "man -l vdstream.1 printed nothing"
grep -A1 '^NAME' "$E2E_TMP/vdstream.txt" | grep -q "vdstream - Stream one golden disk image" ||
    fail "vdstream(1)'s NAME line: $(grep -A1 '^NAME' "$E2E_TMP/vdstream.txt")"
grep -q "vdstream: stream" "$E2E_TMP/vdstream.txt" && fail "vdstream(1) still says 'vdstream - vdstream: stream'"

# check_blocks COMMAND PAGE — every line of COMMAND's --help after "Examples:" (and
# "Exit status:", where it has one) is a line of PAGE, its spacing kept.
check_blocks() {
    local cmd=$1 page=$2 n=0 line
    # shellcheck disable=SC2086
    "$VDSTREAM_BIN" $cmd --help >"$E2E_TMP/help.txt"
    render "$page" >"$E2E_TMP/page.txt"
    grep -q '^Examples:$' "$E2E_TMP/help.txt" || fail "vdstream $cmd --help has no Examples block"
    grep -q '^EXAMPLES$' "$E2E_TMP/page.txt" || fail "$page has no EXAMPLES section"
    if grep -q '^Exit status:$' "$E2E_TMP/help.txt"; then
        grep -q '^EXIT STATUS$' "$E2E_TMP/page.txt" || fail "$page has no EXIT STATUS section"
    fi
    while IFS= read -r line; do
        [[ -n ${line// /} ]] || continue
        grep -qF -- "${line#  }" "$E2E_TMP/page.txt" || fail "$page lost the --help line '$line'"
        n=$((n + 1))
    done < <(awk '/^(Examples|Exit status):$/ { on = 1; next } /^[^ ]/ { on = 0 } on' "$E2E_TMP/help.txt")
    ((n >= 2)) || fail "vdstream $cmd --help has only $n example and exit-status lines"
    log "ok: $page keeps the $n lines of its Examples and Exit status blocks"
}
check_blocks "" vdstream.1
check_blocks server vdstream-server.1
check_blocks "target attach" vdstream-target-attach.1
log "ok: the man pages name vdstream once and keep --help's blocks as written"

# Bash completion (`vdstream completions bash`, what the package installs) offers the
# cache types' names after --cache, not file names, for a record and for an attach.
"$VDSTREAM_BIN" completions bash >"$E2E_TMP/vdstream.bash"
# The script asks the vdstream on PATH, as an installed one does.
mkdir -p "$E2E_TMP/bin"
ln -s "$VDSTREAM_BIN" "$E2E_TMP/bin/vdstream"
# complete WORDS... — what bash completion offers for the last word.
complete_words() {
    PATH="$E2E_TMP/bin:$PATH" bash -c 'source "$1"; shift
        COMP_WORDS=("$@"); COMP_CWORD=$(($# - 1)); COMP_LINE="$*"; COMP_POINT=${#COMP_LINE}
        _clap_complete_vdstream vdstream "${COMP_WORDS[COMP_CWORD]}" "${COMP_WORDS[COMP_CWORD - 1]}"; echo "${COMPREPLY[*]}"' \
        sh "$E2E_TMP/vdstream.bash" "$@"
}
got=$(complete_words vdstream target add vm1 --vdisk w --cache "")
for t in server server-persistent device-disk device-disk-persistent device-ram ram-overflow; do
    [[ " $got " == *" $t "* ]] || fail "completion of 'target add --cache' lacks $t: '$got'"
done
got=$(complete_words vdstream target add vm1 --cache ram)
[[ $got == ram-overflow ]] || fail "completion of 'target add --cache ram' gave '$got', want ram-overflow"
got=$(complete_words vdstream target attach vm1 --cache device-d)
[[ " $got " == *" device-disk "* && " $got " == *" device-disk-persistent "* ]] ||
    fail "completion of 'target attach --cache device-d' gave '$got'"
got=$(complete_words vdstream version promote w 1 --to "")
[[ " $got " == *" production "* && " $got " == *" test "* ]] || fail "completion of 'version promote --to' gave '$got'"
log "ok: bash completion offers the cache types after --cache and the stages after --to"

# The store's names: vDisks where a command takes one, target ids where it takes one.
export VDSTREAM_STORE=$E2E_TMP/store
for v in win11 lin; do "$VDSTREAM_BIN" vdisk create "$v" --size 1M >/dev/null; done
"$VDSTREAM_BIN" target add vm1 --vdisk win11 --cache server >/dev/null
"$VDSTREAM_BIN" target add vm2 --vdisk lin --cache server >/dev/null
got=$(complete_words vdstream vdisk show "")
[[ " $got " == *" win11 "* && " $got " == *" lin "* ]] || fail "completion of 'vdisk show' gave '$got', want win11 and lin"
got=$(complete_words vdstream version new w)
[[ $got == win11 ]] || fail "completion of 'version new w' gave '$got', want win11"
got=$(complete_words vdstream target add vm3 --vdisk l)
[[ $got == lin ]] || fail "completion of 'target add --vdisk l' gave '$got', want lin"
got=$(complete_words vdstream target set vm)
[[ " $got " == *" vm1 "* && " $got " == *" vm2 "* ]] || fail "completion of 'target set vm' gave '$got', want vm1 and vm2"
got=$(complete_words vdstream target remove vm2)
[[ $got == vm2 ]] || fail "completion of 'target remove vm2' gave '$got'"
got=$(complete_words vdstream target status vm1)
[[ $got == vm1 ]] || fail "completion of 'target status vm1' gave '$got'"
# Where the store cannot be read: no names, and nothing on the terminal.
got=$(VDSTREAM_STORE=$E2E_TMP/none complete_words vdstream vdisk show w 2>"$E2E_TMP/complete.err")
[[ -z $got && ! -s $E2E_TMP/complete.err ]] || fail "completion without a store gave '$got' ($(cat "$E2E_TMP/complete.err"))"
log "ok: bash completion offers the store's vDisk names and target ids, and nothing without a store"
# A mistyped cache type is named, with what was meant.
rc=0
"$VDSTREAM_BIN" target add vm1 --vdisk w --cache ram-overflw --store "$E2E_TMP/none" >/dev/null 2>"$E2E_TMP/err.txt" || rc=$?
assert_eq "exit status of a mistyped --cache" "$rc" 2
grep -q "ram-overflow" "$E2E_TMP/err.txt" || fail "a mistyped --cache does not suggest ram-overflow: $(cat "$E2E_TMP/err.txt")"
log "ok: a mistyped --cache is refused with the type it resembles"
