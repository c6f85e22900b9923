"""One line of the console in a real browser (Debian's chromium, driven by Playwright): opens
API_URL/console and waits until the text of SELECTOR matches REGEX (a Python regular
expression, searched), at most SECONDS. Run by test-rebalance.sh (a server's share and
moves) and test-boot-pacing-storm.sh (machines booting and waiting).

Usage: console_line.py API_URL SELECTOR REGEX SECONDS [READY_FILE]
With READY_FILE, creates it once the page shows the element with any text (a test starts
what the line should show only then). Prints the text it matched; exits 1 when none matched
in time, with the page's timeline on standard error: each change of the line or of the
live-updates pill, with the seconds since the page opened, so a failure says whether the
page stopped receiving events or received events that never showed the state.
"""

import re
import sys
import time

from chromium_flags import CHROMIUM, CHROMIUM_ARGS
from playwright.sync_api import sync_playwright

url, selector, pattern, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
ready = sys.argv[5] if len(sys.argv) > 5 else None
wanted = re.compile(pattern)

with sync_playwright() as p:
    browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(url + "/console", timeout=int(seconds * 1000))
    opened = time.monotonic()
    deadline = opened + seconds
    text = ""
    timeline = []
    while time.monotonic() < deadline:
        text = page.locator(selector).text_content(timeout=int(seconds * 1000)) or ""
        live = page.locator("#live").text_content(timeout=int(seconds * 1000)) or ""
        if not timeline or timeline[-1][1:] != (live, text):
            timeline.append((time.monotonic() - opened, live, text))
        if ready and text:
            open(ready, "w").close()
            ready = None
        if wanted.search(text):
            break
        time.sleep(0.2)
    browser.close()

if errors:
    print(f"console_line: the page failed: {errors}", file=sys.stderr)
    sys.exit(1)
if not wanted.search(text):
    for at, live, seen in timeline[-20:]:
        print(f"console_line: {at:6.1f} s  [{live}]  {seen}", file=sys.stderr)
    print(f"console_line: {selector} never matched {pattern!r} within {seconds} s; last text: {text!r}", file=sys.stderr)
    sys.exit(1)
print(text)
