#!/usr/bin/env bash
# The console (`vdstream server --http`, /console) in a real browser: Debian's chromium
# driven by Playwright (console_browser.py). A real agent attaches pc-01 through the
# server's API and fio runs through it; on the page an operator signs in with a token,
# sees pc-01 running with moving IOPS and the version it runs, adds and edits a target,
# promotes a version (after which pc-01 is marked behind production) (now and on a
# schedule), makes one and reverts one, and removes a target; each change is
# checked where the farm keeps it (the API, `vdstream version list`). A merge the store
# refuses, removing a target whose agent runs, and promoting with a read-only token show
# the server's error and change nothing.
# Screenshots of every view, on a laptop's and a phone's screen, are kept in
# target/test-logs/console/ (look at them).
# shellcheck source=lib.sh
source "$(dirname "$0")/lib.sh"
source "$(dirname "$0")/store-lib.sh"
source "$(dirname "$0")/api-lib.sh"
source "$(dirname "$0")/agent-lib.sh"
require chromium fio curl
require_vdstream
"$PY" -c 'import playwright' 2>/dev/null || skip "the Python module playwright is missing (scripts/test installs it with pip)"
e2e_init
store_init

vds vdisk create golden --size 64M >/dev/null
vds version new golden >/dev/null
vds target add pc-01 --vdisk golden --cache ram-overflow --description "front desk" >/dev/null
vds target add pc-02 --vdisk golden --cache device-disk --mac 52:54:00:00:00:02 >/dev/null
vds target add vm-7 --vdisk golden --cache device-disk --description "a VM that migrates" >/dev/null
admin=$(vds token add console-admin --role admin --json | json_get /dev/stdin 'j["token"]')
viewer=$(vds token add console-viewer --role read-only --json | json_get /dev/stdin 'j["token"]')
operator=$(vds token add pc-01-agent --role operator --json | json_get /dev/stdin 'j["token"]')
[[ $admin == vdst_* && $viewer == vdst_* ]] || fail "token add did not print tokens"

start_api
VDSTREAM_TOKEN=$operator start_agent pc-01 --server "$API_URL"

# fio through the agent for the page to show (bounded; stopped by the EXIT trap if need be).
fio --name=console --ioengine=nbd --uri="$URI" --rw=randrw --rwmixwrite=70 --bs=4k --iodepth=8 \
    --size=48m --time_based --runtime=90 --output="$E2E_TMP/fio.log" >/dev/null 2>&1 &
track_pid $!

shots=$REPO_ROOT/target/test-logs/console
rm -rf "$shots" && mkdir -p "$shots"
"$PY" "$E2E_DIR/console_browser.py" "$API_URL" "$admin" "$viewer" "$VDSTREAM_BIN" "$STORE" "$shots" >&2 ||
    fail "the console failed in the browser (screenshots so far in target/test-logs/console/; server log: $API_LOG)"
for f in laptop-targets laptop-vdisks laptop-sessions laptop-audit laptop-refused-remove laptop-refused-promote phone-targets phone-vdisks; do
    [[ -s $shots/$f.png ]] || fail "no screenshot $f.png"
done
grep -q 'refused to remove target "pc-01"' "$API_LOG" || fail "the server's log does not name the refused removal: $(tail -n 20 "$API_LOG")"
log "ok: the console works in chromium; screenshots in target/test-logs/console/"
