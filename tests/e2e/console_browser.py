"""The console in a real browser (Debian's chromium, driven by Playwright): what an
operator does on the page, checked where the farm keeps it (the API, `vdstream version
list`). Run by test-console-browser.sh, which starts the server, a real agent for pc-01
and fio through it.

Usage: console_browser.py API_URL ADMIN_TOKEN VIEWER_TOKEN VDSTREAM_BIN STORE SHOTS_DIR
Prints what it checked; exits non-zero (an AssertionError naming the check) on failure.
"""

import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

from chromium_flags import CHROMIUM, CHROMIUM_ARGS
from playwright.sync_api import sync_playwright, expect

url, admin, viewer, vdstream, store, shots = sys.argv[1:7]
problems = []  # page errors and CSP refusals, from every page


def say(text):
    print(f"console_browser: {text}", flush=True)


def api_status(path, token):
    req = urllib.request.Request(url + path, headers={"Authorization": f"Bearer {token}"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def api_put(path, token, body):
    req = urllib.request.Request(url + path, data=json.dumps(body).encode(), method="PUT",
                                 headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return r.status


def migration_report(role, phase, rounds, moved, fenced_ms):
    now = int(time.time() * 1000)
    return {"target": "vm-7", "state": "running", "server": {"endpoint": "http://127.0.0.1:8480", "connected": True}, "migration": {
        "role": role, "phase": phase, "peer": "tls://10.0.0.1:10811", "rounds": rounds,
        "data_bytes": moved, "fenced_ms": fenced_ms, "started_unix_ms": now - 5000,
        "finished_unix_ms": now if phase == "done" else 0,
        **({"qemu_downtime_ms": 19} if phase == "done" else {})}}


def versions():
    out = subprocess.run([vdstream, "version", "list", "golden", "--store", store, "--json"], check=True, capture_output=True, text=True, timeout=30)
    return {v["number"]: v for v in json.loads(out.stdout)["versions"]}


def watch(page):
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}") if m.type == "error" else None)


def sign_in(page, token):
    page.click("#token-button")
    expect(page.locator("#login")).to_be_visible()
    page.fill("#login-token", token)
    page.click("#login-ok")


def confirm(page, expect_text, ok=True):
    """Checks the confirmation names the change, then confirms (or cancels)."""
    expect(page.locator("#confirm")).to_be_visible()
    text = page.locator("#confirm-text").inner_text()
    for t in expect_text:
        assert t in text, f"the confirmation does not name {t!r}: {text!r}"
    page.click("#confirm-ok" if ok else "#confirm-cancel")
    return text


def iops_of(page, target):
    t = page.locator(f'tr[data-target="{target}"] .iops .nums .g').inner_text().strip()
    if t in ("", "–"):
        return 0.0
    return float(t[:-1]) * 1000 if t.endswith("k") else float(t)


with sync_playwright() as p:
    browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
    # UTC: the scheduled release typed below is read as the browser's local time.
    page = browser.new_page(viewport={"width": 1366, "height": 860}, timezone_id="UTC")
    watch(page)

    # 1. The page loads; the API needs a token, so it asks for one.
    page.goto(url + "/")
    assert page.url.endswith("/console"), f"/ did not lead to /console but to {page.url}"
    expect(page.locator("#login")).to_be_visible(timeout=10000)
    page.fill("#login-token", admin)
    page.click("#login-ok")
    expect(page.locator("#live")).to_have_text("live", timeout=10000)
    say("the page loaded, asked for a token and follows the live events")

    # 2. The attached target shows, and its IOPS move while fio runs.
    row = page.locator('tr[data-target="pc-01"]')
    expect(row).to_be_visible(timeout=10000)
    expect(row.locator(".state")).to_have_text("running", timeout=15000)
    seen = []
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len({v for v in seen if v > 0}) < 3:
        seen.append(iops_of(page, "pc-01"))
        time.sleep(1)
    moving = sorted({v for v in seen if v > 0})
    assert len(moving) >= 3, f"pc-01's guest IOPS did not move on the page while fio ran: {seen}"
    assert "ram-overflow" in row.locator(".c-cache").inner_text()
    # The version it runs (production is the base until a promote), not only the record's stage.
    expect(row.locator(".c-vdisk")).to_contain_text("runs base (production)", timeout=15000)
    say(f"pc-01 is running and its guest IOPS moved: {seen}")

    # 2b. A target that migrates live: its agents' reports show the phase and what moved.
    mig = page.locator('tr[data-target="vm-7"] .migration')
    assert api_put("/api/v1/targets/vm-7/agent", admin, migration_report("destination", "converged", 3, 4 << 20, 0)) == 200
    expect(mig).to_have_text("migrating in: converged · 3 rounds · 4.0 MiB moved", timeout=15000)
    assert api_put("/api/v1/targets/vm-7/agent", admin, migration_report("destination", "done", 5, 6 << 20, 14)) == 200
    expect(mig).to_contain_text("migrated in · 5 rounds · 6.0 MiB moved · downtime 19 ms · fenced 14 ms", timeout=15000)
    say(f"vm-7's live migration shows its phase and figures: {mig.inner_text()!r}")
    page.screenshot(path=f"{shots}/laptop-targets.png", full_page=True)

    # 3. Add and edit a target on the page.
    page.click("#add-target")
    page.fill('#confirm input[name="id"]', "lab-9")
    page.select_option('#confirm select[name="cache"]', "device-disk")
    page.fill('#confirm input[name="description"]', "lab machine 9")
    confirm(page, ["lab-9", "golden", "device-disk"])
    expect(page.locator('tr[data-target="lab-9"]')).to_be_visible(timeout=10000)
    st, doc = api_status("/api/v1/targets/lab-9", admin)
    assert st == 200 and doc["cache"] == "device-disk" and doc["description"] == "lab machine 9", (st, doc)
    page.locator('tr[data-target="lab-9"] button', has_text="Edit").click()
    page.select_option('#confirm select[name="cache"]', "device-ram")
    confirm(page, ["lab-9", "cache device-disk → device-ram"])
    expect(page.locator('tr[data-target="lab-9"] .c-cache')).to_contain_text("device-ram", timeout=10000)
    st, doc = api_status("/api/v1/targets/lab-9", admin)
    assert st == 200 and doc["cache"] == "device-ram", (st, doc)
    say("a target added and edited on the page is so in the API")

    # 4. A promote made on the page shows up in `vdstream version list`; then a new version.
    page.click("button[data-tab=vdisks]")
    card = page.locator('.vdisk[data-vdisk="golden"]')
    expect(card).to_be_visible()
    card.locator('.layer[data-layer="1"] button', has_text="Promote").click()
    page.select_option('#confirm select[name="to"]', "production")
    confirm(page, ["Version 1 of golden", "from maintenance to production", "now"])
    expect(card.locator('.layer[data-layer="1"] .access')).to_have_text("production", timeout=10000)
    v = versions()
    assert v[1]["access"] == "production", f"vdstream version list does not show the promote: {v[1]}"
    card.locator("button", has_text="New version").click()
    page.fill('#confirm input[name="note"]', "patch tuesday")
    confirm(page, ["maintenance version of golden", "patch tuesday"])
    expect(card.locator('.layer[data-layer="2"]')).to_be_visible(timeout=10000)
    assert versions()[2]["access"] == "maintenance"
    say("version 1 promoted to production on the page (vdstream version list agrees); version 2 made")
    # pc-01 still runs the base it booted: the Targets tab says so, and that a reboot moves it.
    page.click("button[data-tab=targets]")
    expect(row.locator(".c-vdisk")).to_contain_text("runs base (production)", timeout=15000)
    expect(row.locator(".c-vdisk .behind")).to_contain_text("production is version 1 now; its next boot picks it up", timeout=15000)
    say("pc-01 runs the base behind production (version 1); the Targets tab marks it")
    page.click("button[data-tab=vdisks]")

    # A scheduled release: the confirmation names the time; the store keeps it.
    card.locator('.layer[data-layer="2"] button', has_text="Promote").click()
    page.select_option('#confirm select[name="to"]', "production")
    page.fill('#confirm input[name="at"]', "2031-06-01T09:30")
    confirm(page, ["Version 2 of golden", "to production", "2031"])
    expect(card.locator('.layer[data-layer="2"]')).to_contain_text("scheduled for", timeout=10000)
    v = versions()
    assert v[2]["access"] == "production" and v[2].get("scheduled_at", "").startswith("2031-06-01"), v[2]
    assert v[1]["access"] == "production", "version 1 stopped serving production before version 2's release"
    say(f"version 2 scheduled for production at {v[2]['scheduled_at']}; version 1 serves until then")
    page.screenshot(path=f"{shots}/laptop-vdisks.png", full_page=True)

    # A merge the store refuses (production boots version 1, with nothing below it to
    # merge) shows its reason and changes nothing; a revert takes version 2 back to test.
    before = versions()
    card.locator("button", has_text="Merge").click()
    confirm(page, ["golden", "one version on the base"])
    expect(page.locator("#confirm-error")).to_contain_text("nothing below it to merge", timeout=10000)
    page.click("#confirm-cancel")
    assert versions() == before, f"a refused merge changed the store: {before} -> {versions()}"
    card.locator("button", has_text="Revert").click()
    page.select_option('#confirm select[name="version"]', "2")
    confirm(page, ["Version 2 of golden", "steps back from production"])
    expect(card.locator('.layer[data-layer="2"] .access')).to_have_text("test", timeout=10000)
    v = versions()
    assert v[2]["access"] == "test" and v[1]["access"] == "production", (v[1], v[2])
    say("a refused merge showed its reason and changed nothing; version 2 reverted to test on the page")

    # 5. A target removed on the page is gone from the API.
    page.click("button[data-tab=targets]")
    page.locator('tr[data-target="pc-02"] button', has_text="Remove").click()
    confirm(page, ["pc-02", "deleted"])
    expect(page.locator('tr[data-target="pc-02"]')).to_have_count(0, timeout=10000)
    st, _ = api_status("/api/v1/targets/pc-02", admin)
    assert st == 404, f"pc-02 removed on the page still answers {st}"
    say("pc-02 removed on the page is gone from the API (404)")

    # 6. Bad actions show the error and change nothing.
    # 6a. Removing a target with a live session (its agent runs).
    page.locator('tr[data-target="pc-01"] button', has_text="Remove").click()
    confirm(page, ["pc-01"])
    err = page.locator("#confirm-error")
    expect(err).to_be_visible(timeout=10000)
    expect(err).to_contain_text("in use")
    expect(page.locator("#banner")).to_contain_text("nothing was changed")
    page.screenshot(path=f"{shots}/laptop-refused-remove.png")
    page.click("#confirm-cancel")
    st, _ = api_status("/api/v1/targets/pc-01", admin)
    assert st == 200, f"a refused removal removed pc-01 ({st})"
    expect(page.locator('tr[data-target="pc-01"]')).to_be_visible()
    say(f"removing pc-01 while its agent runs: refused on the page ({err.inner_text()!r}); the record stays")

    # 6b. Promoting without rights (a read-only token).
    sign_in(page, viewer)
    page.click("button[data-tab=vdisks]")
    before = versions()
    card.locator('.layer[data-layer="2"] button', has_text="Promote").click()
    page.select_option('#confirm select[name="to"]', "production")
    confirm(page, ["Version 2 of golden", "to production", "now"])
    expect(err).to_be_visible(timeout=10000)
    expect(err).to_contain_text("needs role admin")
    page.screenshot(path=f"{shots}/laptop-refused-promote.png")
    page.click("#confirm-cancel")
    after = versions()
    assert after == before, f"a refused promote changed the store: {before} -> {after}"
    say(f"promoting with a read-only token: refused on the page ({err.inner_text()!r}); the versions are unchanged")

    # 7. The other views, and a phone's screen.
    sign_in(page, admin)
    page.click("button[data-tab=sessions]")
    expect(page.locator("#sessions tbody tr").first).to_be_visible(timeout=10000)
    page.screenshot(path=f"{shots}/laptop-sessions.png", full_page=True)
    page.click("button[data-tab=audit]")
    expect(page.locator("#audit tbody")).to_contain_text("version.promote", timeout=10000)
    expect(page.locator("#audit tbody")).to_contain_text("target.remove")
    expect(page.locator("#audit tbody")).to_contain_text("target.migrate")
    page.screenshot(path=f"{shots}/laptop-audit.png", full_page=True)
    say("sessions and the audit trail (with the page's promote and removal) show")

    phone = browser.new_page(viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    watch(phone)
    phone.goto(url + "/console")
    expect(phone.locator("#login")).to_be_visible(timeout=10000)
    phone.fill("#login-token", admin)
    phone.click("#login-ok")
    expect(phone.locator('tr[data-target="pc-01"]')).to_be_visible(timeout=10000)
    width = phone.evaluate("document.documentElement.scrollWidth")
    assert width <= 390, f"the targets view is {width} px wide on a 390 px phone screen"
    phone.screenshot(path=f"{shots}/phone-targets.png", full_page=True)
    phone.click("button[data-tab=vdisks]")
    phone.screenshot(path=f"{shots}/phone-vdisks.png", full_page=True)
    say("the page fits a 390 px phone screen")

    browser.close()

refused = [p for p in problems if "Refused to" in p or "page error" in p]
assert not refused, f"the page hit errors or its CSP refused something: {refused}"
say("no page errors, nothing refused by the page's CSP")
