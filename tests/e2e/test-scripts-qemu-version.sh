#!/usr/bin/env bash
# scripts/test upgrades a qemu older than the tests need (scripts/versions.sh: QEMU_MIN,
# 8.2, the first qemu-img whose `map --output=json` reports "compressed"). Its version
# logic on fake `--version` texts: Debian 12's own 7.2 is too old, bookworm-backports'
# 10.0.2 and 8.2.0 will do, numbers compare as numbers (8.10 > 8.2), a missing tool or an
# unreadable version is reported; and on this machine, the installed qemu-img passes.
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
e2e_init
# shellcheck source=../../scripts/versions.sh
source "$REPO_ROOT/scripts/versions.sh"

assert_eq "version_of Debian 12's qemu-img" "$(version_of 'qemu-img version 7.2.19 (Debian 1:7.2+dfsg-7+deb12u18)')" 7.2.19
assert_eq "version_of backports' qemu-img" "$(version_of 'qemu-img version 10.0.2 (Debian 1:10.0.2+ds-2+deb13u1~bpo12+1)')" 10.0.2
assert_eq "version_of without a number" "$(version_of 'qemu-img version unknown')" ""

ok() { version_at_least "$1" "$2" || fail "$1 should be >= $2"; }
older() { ! version_at_least "$1" "$2" || fail "$1 should be < $2"; }
ok 8.2 8.2
ok 8.2.0 8.2
ok 10.0.2 8.2
ok 8.10 8.2
ok 9 8.2
older 7.2.19 8.2
older 8.1.5 8.2
older 8 8.2
older 8.1.99 8.2
log "ok: version_at_least compares number by number"

problem() { QEMU_VERSION_TEXT=$1 qemu_problem qemu-img; }
p=$(problem 'qemu-img version 7.2.19 (Debian 1:7.2+dfsg-7+deb12u18)')
[[ $p == *"version 7.2.19, older than 8.2"*"compressed"*"bookworm-backports"* ]] || fail "7.2: $p"
[[ -z $(problem 'qemu-img version 10.0.2 (Debian 1:10.0.2+ds-2+deb13u1~bpo12+1)') ]] || fail "10.0.2 was refused"
[[ -z $(problem 'qemu-img version 8.2.2 (Debian 1:8.2.2+ds-0ubuntu1)') ]] || fail "8.2.2 was refused"
[[ $(problem 'qemu-img version ?') == *"cannot tell the version"* ]] || fail "an unreadable version was taken"
p=$(PATH=/nonexistent qemu_problem qemu-img)
[[ $p == "qemu-img is not installed" ]] || fail "a missing qemu-img: $p"
log "ok: qemu_problem explains 7.2, passes 8.2 and 10.0.2"

# scripts/test's own decision on those texts: it upgrades (need_tools says tools are
# needed) exactly when a tool is too old.
decide() {
    QEMU_VERSION_TEXT=$1 bash -c '
        source "$1/scripts/versions.sh"
        eval "$(sed -n "/^qemu_too_old() {/,/^}/p" "$1/scripts/test")"
        qemu_too_old && echo upgrade || echo keep' _ "$REPO_ROOT"
}
assert_eq "scripts/test with qemu 7.2" "$(decide 'qemu-img version 7.2.19 (Debian 1:7.2+dfsg-7+deb12u18)')" upgrade
assert_eq "scripts/test with qemu 10.0.2" "$(decide 'qemu-img version 10.0.2 (Debian)')" keep

if command -v qemu-img >/dev/null; then
    p=$(qemu_problem qemu-img)
    [[ -z $p ]] || fail "this machine's qemu-img: $p"
    log "ok: this machine's $(qemu-img --version | head -n1) will do"
fi
