# shellcheck shell=bash
# scripts/versions.sh — the tool versions the tests need, and how to tell (sourced by
# scripts/test and by tests/e2e/test-scripts-qemu-version.sh, which feeds it fake
# version strings).
#
#   QEMU_MIN                      oldest qemu (qemu-img, qemu-io, qemu-system-x86) the
#                                 tests accept: 8.2, the first whose `qemu-img map
#                                 --output=json` reports "compressed" (crates/qcow2
#                                 tests/read_qemu.rs). Debian 12 ships 7.2; its
#                                 bookworm-backports has 10.x.
#   version_of TEXT               the first dotted version number in TEXT ("qemu-img
#                                 version 7.2.19 (Debian ...)" -> 7.2.19), or nothing
#   version_at_least HAVE WANT    status 0 if HAVE >= WANT, compared number by number
#   qemu_problem [TOOL]           prints why the installed TOOL (default qemu-img) will not
#                                 do (missing, or older than QEMU_MIN); nothing if it will.
#                                 QEMU_VERSION_TEXT overrides `TOOL --version` (for tests).

QEMU_MIN=8.2

version_of() {
    [[ $1 =~ ([0-9]+(\.[0-9]+)+) ]] && printf '%s\n' "${BASH_REMATCH[1]}"
    return 0
}

version_at_least() {
    local have=$1 want=$2 i h w
    local -a hs ws
    IFS=. read -ra hs <<<"$have"
    IFS=. read -ra ws <<<"$want"
    for ((i = 0; i < ${#hs[@]} || i < ${#ws[@]}; i++)); do
        h=$((10#${hs[i]:-0})) w=$((10#${ws[i]:-0}))
        ((h > w)) && return 0
        ((h < w)) && return 1
    done
    return 0
}

qemu_problem() {
    local tool=${1:-qemu-img} text version
    if [[ -n ${QEMU_VERSION_TEXT:-} ]]; then
        text=$QEMU_VERSION_TEXT
    elif command -v "$tool" >/dev/null 2>&1; then
        text=$("$tool" --version 2>/dev/null | head -n1)
    else
        echo "$tool is not installed"
        return 0
    fi
    version=$(version_of "$text")
    if [[ -z $version ]]; then
        echo "cannot tell the version of $tool from: $text"
    elif ! version_at_least "$version" "$QEMU_MIN"; then
        echo "$tool is version $version, older than $QEMU_MIN (the first whose \`qemu-img map --output=json\` reports \"compressed\", which crates/qcow2/tests/read_qemu.rs checks); on Debian 12 install qemu-utils and qemu-system-x86 from bookworm-backports"
    fi
    return 0
}
