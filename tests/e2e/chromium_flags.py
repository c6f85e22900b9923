"""The flags every Playwright-driven Chromium of the tests and benchmarks starts with.

Beside --no-sandbox (root) and --disable-gpu (no display): Chromium's own traffic
(component updates, sync, background fetches, QUIC probes) is turned off, so that on a
machine without outside network its failing lookups and refused connections neither slow
the browser nor fill its logs while a test watches a page on 127.0.0.1.
"""

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
