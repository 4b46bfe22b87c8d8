"""Headless Chromium: the lease timeline, the DAG tab and the live colour mode, in the real Airflow UI.

The api-server and the real DAG runs are the ``world`` of conftest.py (a run that crashed holding
``ui-demo``, one skipped for it, a fence rejection of the crashed holder). On top, a key with three
days of history written through the core API (tests/ui/timeline_seed.py): holdings that ended every
way, overlap skips, a catch-up gap of 6 slots, a fence rejection. Screenshots go to tests/_artifacts/.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import quote

import pytest

from tests.ui import test_browser
from tests.ui.conftest import World
from tests.ui.server import DAG_ID, LEASE_KEY, password
from tests.ui.test_browser import ARTIFACTS, NARROW, WIDE, login, no_horizontal_scroll, shoot
from tests.ui.timeline_seed import KEY, Seeded, seed

pytestmark = [pytest.mark.airflow, pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.needs("chromium")]
#: The Chromium of test_browser.py (Debian's, through Playwright), one per module.
browser = test_browser.browser


@pytest.fixture(scope="module")
def history(world: World) -> Seeded:
    return seed(world.store)


def open_leases(page: Any) -> Any:
    page.get_by_role("button", name="Browse").click()
    page.get_by_role("menuitem", name="Leases").click()
    page.wait_for_url(re.compile(r".*/plugin/leases.*"))
    frame = page.frame_locator("iframe[title=Leases]")
    frame.locator("svg.timeline").wait_for()
    return frame


def show_key(frame: Any, key: str, range_name: str = "7d") -> Any:
    frame.locator("#timeline-key").select_option(key)
    frame.locator(f"#timeline-range button[data-range='{range_name}']").click()
    # The block drawn from this key's and range's reply (the previous one is replaced).
    block = frame.locator(f"#timeline .timeline-block[data-key='{key}'][data-range='{range_name}']")
    block.wait_for()
    return block


def outcomes(block: Any) -> dict[int, str]:
    found = block.locator("svg.timeline g.holding").evaluate_all(
        "gs => gs.map(g => [Number(g.dataset.token), g.dataset.outcome])"
    )
    return {token: outcome for token, outcome in found}


def test_timeline_shows_holdings_and_markers(browser: Any, world: World, history: Seeded) -> None:
    page = login(browser, world, "admin")
    frame = open_leases(page)
    block = show_key(frame, KEY, "7d")
    # One bar per holding, coloured by how it ended: every way the seed ended one.
    # Waited for in the 7d block itself: a wait on any block of the key could be met by the block of the
    # range shown before, which the 7d reply then replaces (red once in a loaded run: no bars yet).
    block.locator("g.holding[data-outcome=expired]").wait_for()
    assert outcomes(block) == history.outcomes
    assert set(history.outcomes.values()) == {"released", "reentered", "force_released", "lost", "expired"}
    kinds = block.locator("svg.timeline g.marker").evaluate_all("gs => gs.map(g => g.dataset.kind)")
    assert sorted(k for k in kinds if k != "skipped_catchup") == ["fence_rejected", "skipped_overlap", "skipped_overlap"]
    # Catch-up skips of the key's DAG, with their slot counts: the seeded gap and the world's one (14).
    counts = block.locator("g.m-skipped_catchup .marker-count").evaluate_all("ts => ts.map(t => t.textContent)")
    assert str(history.catchup_slots) in counts and "14" in counts
    # The article's number: 2 overlap skips of 9 attempts (7 runs took the lease: a retry is not a run).
    assert block.locator(".share-value").inner_text() == "22%"
    assert "2 of 9 attempt(s) in 7 days" in block.locator(".share").inner_text()
    assert block.locator(".gaps li[data-slots='6']").count() == 1
    # A marker's details: the fence rejection names the tokens.
    block.locator("g.m-fence_rejected").click()
    assert "rejected token" in block.locator(".timeline-detail").inner_text()
    no_horizontal_scroll(frame)
    shoot(page, "timeline-1280")

    # 24 hours: only what ended in the last day (the force-release 19 h ago and later).
    block = show_key(frame, KEY, "24h")
    frame.locator(f"#timeline .timeline-block[data-key='{KEY}'] g.holding").first.wait_for()
    assert sorted(outcomes(block).values()) == ["expired", "force_released", "lost", "released"]

    # The real crashed run holds ui-demo: its bar says so, and its details link to the run in Airflow.
    block = show_key(frame, LEASE_KEY, "24h")
    bar = block.locator("g.holding[data-outcome=held]")
    assert bar.count() == 1
    bar.click()
    link = block.locator(".timeline-detail a", has_text=world.holder_run)
    assert link.get_attribute("href") == f"/dags/{DAG_ID}/runs/{quote(world.holder_run, safe='')}"
    kinds = block.locator("svg.timeline g.marker").evaluate_all("gs => gs.map(g => g.dataset.kind)")
    assert {"skipped_overlap", "fence_rejected", "skipped_catchup"} <= set(kinds)
    shoot(page, "timeline-ui-demo-1280")
    link.click()
    page.wait_for_url(re.compile(rf".*/dags/{DAG_ID}/runs/.*"))
    page.get_by_text(world.holder_run).first.wait_for()
    page.close()


def test_a_block_that_replaces_another_is_drawn_when_it_appears(browser: Any, world: World, history: Seeded) -> None:
    """A new reply (another range, or the page's refresh) replaces the block: the new one is drawn in the
    same task, so no frame shows a block without its chart (before, a block was drawn on the next frame,
    and a reading between the two found holdings gone and no markers: red once in CI)."""
    page = login(browser, world, "admin")
    page.goto(f"{world.server.url}/lease/ui/?tkey={quote(KEY)}")
    page.locator(f"#timeline .timeline-block[data-key='{KEY}'] svg.timeline g.holding").first.wait_for()
    # What each block had when it was put in the page (a MutationObserver runs before the next frame).
    page.evaluate("""() => {
      window.seenBlocks = [];
      new MutationObserver((records) => {
        for (const r of records) for (const n of r.addedNodes) {
          if (n.classList && n.classList.contains("timeline-block")) {
            window.seenBlocks.push([n.dataset.range, n.querySelectorAll("svg.timeline g.holding").length]);
          }
        }
      }).observe(document.getElementById("timeline"), { childList: true });
    }""")
    for range_name in ("24h", "7d", "30d", "7d"):
        page.locator(f"#timeline-range button[data-range='{range_name}']").click()
        page.locator(f"#timeline .timeline-block[data-range='{range_name}'] svg.timeline g.holding").first.wait_for()
    seen = page.evaluate("window.seenBlocks")
    assert [r for r, _ in seen][-4:] == ["24h", "7d", "30d", "7d"], seen
    assert all(holdings > 0 for _, holdings in seen), seen
    page.close()


def test_timeline_on_a_phone(browser: Any, world: World, history: Seeded) -> None:
    page = login(browser, world, "viewer", NARROW)
    frame = open_leases(page)
    block = show_key(frame, KEY, "24h")
    frame.locator(f"#timeline .timeline-block[data-key='{KEY}'] g.holding").first.wait_for()
    svg = block.locator("svg.timeline").bounding_box()
    assert svg is not None and svg["width"] <= NARROW[0] - 64  # beside Airflow's navigation bar
    no_horizontal_scroll(frame)
    block.locator("g.m-skipped_catchup", has=frame.locator("text", has_text="6")).click()
    assert "6 older slot(s)" in block.locator(".timeline-detail").inner_text()
    # A viewer sees the timeline but gets no force-release button.
    assert frame.locator("#leases button").count() == 0
    shoot(page, "timeline-390")
    page.close()


def test_dag_tab(browser: Any, world: World, history: Seeded) -> None:
    plugins = world.server.request("GET", "/api/v2/plugins", "viewer").json()["plugins"]
    (lease,) = [p for p in plugins if p["name"] == "lease"]
    views = {v["url_route"]: v for v in lease["external_views"]}
    assert views["dag-leases"]["destination"] == "dag"
    assert views["dag-leases"]["href"] == "/lease/ui/dag?dag_id={DAG_ID}"

    page = login(browser, world, "viewer")
    page.goto(f"{world.server.url}/dags/{DAG_ID}")
    page.get_by_text("Leases", exact=True).first.click()  # the tab the plugin adds to every DAG
    page.wait_for_url(re.compile(rf".*/dags/{DAG_ID}/plugin/dag-leases$"))
    frame = page.frame_locator("iframe[title=Leases]")
    frame.locator(f".key-card[data-key='{LEASE_KEY}'] svg.timeline").wait_for()
    frame.locator(f".key-card[data-key='{KEY}'] svg.timeline").wait_for()
    assert frame.locator("#dag-title").inner_text() == f"Leases of {DAG_ID}"
    # The current holder of ui-demo: the crashed run, linked.
    holder = frame.locator(f".key-card[data-key='{LEASE_KEY}'] .holder-line")
    assert "held" in holder.inner_text() and world.holder_run in holder.inner_text()
    # The DAG's own trend: its runs and skips on every key, one number for the share.
    assert re.fullmatch(r"\d+(\.\d)?%", frame.locator("#dag-trend .share-value").inner_text())
    assert frame.locator("#dag-trend .gaps li").count() >= 1
    shoot(page, "dag-tab-1280")
    page.set_viewport_size({"width": NARROW[0], "height": NARROW[1]})
    page.goto(f"{world.server.url}/lease/ui/dag?dag_id={DAG_ID}")
    page.locator(f".key-card[data-key='{KEY}'] svg.timeline").wait_for()
    overflow = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
    assert overflow <= 1
    page.screenshot(path=str(ARTIFACTS / "dag-tab-390.png"), full_page=True)
    page.close()


def test_dag_tab_needs_a_login_and_a_range(world: World) -> None:
    # Read access to the DAG itself is checked through the auth manager: test_fab.py (DAG-level roles).
    assert world.server.request("GET", f"/lease/api/dag?dag_id={DAG_ID}").status_code == 401
    assert world.server.request("GET", f"/lease/api/dag?dag_id={DAG_ID}&range=1y", "viewer").status_code == 422


def _mode(frame: Any) -> str:
    return str(frame.locator("html").get_attribute("class") or "")


def test_dark_mode_is_followed_live(browser: Any, world: World, history: Seeded) -> None:
    # One browser context (one user's cookies and localStorage) with two windows.
    context = browser.new_context(viewport={"width": WIDE[0], "height": WIDE[1]})
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.goto(f"{world.server.url}/auth/login")
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", password("admin"))
    page.click("button[type=submit]")
    page.wait_for_url(lambda url: "/auth/login" not in url)
    frame = open_leases(page)
    show_key(frame, KEY, "24h")
    assert "light" in _mode(frame)
    # A second window with the page itself (not framed): it hears of the change through "storage".
    solo = context.new_page()
    solo.set_default_timeout(60_000)
    solo.goto(f"{world.server.url}/lease/ui/")
    solo.locator("svg.timeline").wait_for()
    assert solo.evaluate("document.documentElement.classList.contains('light')")

    def switch(mode: str) -> None:
        page.get_by_role("button", name="User").click()
        page.get_by_role("menuitem", name="Appearance").click()
        page.get_by_role("menuitemradio", name=mode).click()

    switch("Dark Mode")
    frame.locator("html.dark").wait_for(state="attached")
    solo.wait_for_function("document.documentElement.classList.contains('dark')")
    # The frame's colours are Airflow's own, read from the parent in its new mode.
    parent_bg = page.evaluate("getComputedStyle(document.documentElement).getPropertyValue('--chakra-colors-bg').trim()")
    frame_bg = frame.locator("html").evaluate("h => h.style.getPropertyValue('--bg')")
    assert frame_bg == parent_bg and parent_bg not in ("", "#FFFFFF")
    body_bg = frame.locator("body").evaluate("b => getComputedStyle(b).backgroundColor")
    assert body_bg != "rgb(255, 255, 255)"
    page.keyboard.press("Escape")
    page.wait_for_timeout(300)
    shoot(page, "timeline-dark-1280")

    switch("Light Mode")
    frame.locator("html.light").wait_for(state="attached")
    solo.wait_for_function("document.documentElement.classList.contains('light')")
    assert frame.locator("body").evaluate("b => getComputedStyle(b).backgroundColor") == "rgb(255, 255, 255)"
    context.close()
