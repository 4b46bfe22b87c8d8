"""Headless Chromium in the real Airflow UI: log in, open Leases from the navigation, find the overlap
skip a real DAG run left, force-release through the confirmation dialog, follow a run link, open a task
instance's Lease tab; screenshots at 1280 and 390 px into tests/_artifacts/. With ``LEASE_UI_SCREENSHOT=PATH``
the Leases page as the first test finds it is also written to PATH: the README's picture,
``LEASE_UI_SCREENSHOT=docs/img/leases.png scripts/test tests/ui/test_browser.py``.

Uses Debian's ``chromium`` through Playwright's Python API (``executable_path``): no browser download.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest

from airflow_lease_provider.core import EventKind
from tests.pg import execute, q
from tests.tools import chromium as find_chromium
from tests.tools import require
from tests.ui.conftest import BROWSER_KEY, BUFFER_KEY, World, policy_run, seed_policies
from tests.ui.server import DAG_ID, LEASE_KEY, password

# needs: checked before the session's api-server (``world``) is started for nothing.
pytestmark = [pytest.mark.airflow, pytest.mark.slow, pytest.mark.timeout(900), pytest.mark.needs("chromium")]

ARTIFACTS = Path(__file__).parents[1] / "_artifacts"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WIDE, NARROW = (1280, 900), (390, 844)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    require("chromium")
    from playwright import sync_api  # the test group's; it drives Debian's Chromium, it downloads none

    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=find_chromium(), args=CHROMIUM_ARGS)
        try:
            yield chromium
        finally:
            chromium.close()


def login(browser: Any, world: World, user: str, size: tuple[int, int] = WIDE) -> Any:
    page = browser.new_page(viewport={"width": size[0], "height": size[1]})
    page.set_default_timeout(60_000)
    page.goto(f"{world.server.url}/auth/login")
    page.fill("input[name=username]", user)
    page.fill("input[name=password]", password(user))
    page.click("button[type=submit]")
    page.wait_for_url(lambda url: "/auth/login" not in url)
    return page


def open_leases_from_nav(page: Any) -> Any:
    """Browse > Leases, as a person would; returns the page's frame."""
    page.get_by_role("button", name="Browse").click()
    page.get_by_role("menuitem", name="Leases").click()
    page.wait_for_url(re.compile(r".*/plugin/leases.*"))
    frame = page.frame_locator("iframe[title=Leases]")
    frame.locator("#leases tbody tr[data-key]").first.wait_for()
    frame.locator("#events tbody tr[data-kind]").first.wait_for()
    return frame


def shoot(page: Any, name: str, frame_selector: str = "iframe") -> None:
    """The visible screen, then the whole framed page (the viewport grown to the frame's content)."""
    shoot_plain(page, name)
    size = page.viewport_size
    inner = page.locator(frame_selector).first.content_frame
    height = inner.locator("body").evaluate("b => document.documentElement.scrollHeight")
    page.set_viewport_size({"width": size["width"], "height": max(size["height"], int(height) + 120)})
    page.wait_for_timeout(300)
    page.screenshot(path=str(ARTIFACTS / f"{name}-full.png"))
    page.set_viewport_size(size)


def shoot_plain(page: Any, name: str) -> None:
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"))


def readme_picture(browser: Any, world: World, path: Path) -> None:
    """The README's picture: the Leases page with the demo DAG's key on the timeline (its holding, the
    overlap skip, the catch-up gap and the refused zombie publish), the current leases below it."""
    page = login(browser, world, "admin", (1280, 1180))
    frame = open_leases_from_nav(page)
    frame.locator("#timeline-key").select_option(LEASE_KEY)
    frame.locator("#timeline-range button[data-range='24h']").click()
    frame.locator(f"#timeline .timeline-block[data-key='{LEASE_KEY}'][data-range='24h']").wait_for()
    page.wait_for_timeout(500)  # the bars' transition
    path.parent.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(path))
    page.close()


def no_horizontal_scroll(frame: Any) -> None:
    overflow = frame.locator("body").evaluate(
        "b => document.documentElement.scrollWidth - document.documentElement.clientWidth"
    )
    assert overflow <= 1, f"the page scrolls sideways by {overflow} px"


def test_leases_page_in_the_airflow_ui(browser: Any, world: World) -> None:
    page = login(browser, world, "admin")
    frame = open_leases_from_nav(page)

    # The overlap skip the second DAG run left, with the run that blocked it, linked.
    skip = frame.locator("#events tbody tr[data-kind=skipped_overlap]", has_text=LEASE_KEY)
    skip.wait_for()
    assert world.skipped_run in skip.inner_text()
    blocker = skip.locator(".small a", has_text=world.holder_run)
    assert blocker.get_attribute("href") == f"/dags/{DAG_ID}/runs/{quote(world.holder_run, safe='')}"
    held = frame.locator(f"#leases tbody tr[data-key='{LEASE_KEY}']")
    assert "held" in held.inner_text() and world.holder_run in held.inner_text()
    for kind in ("skipped_catchup", "fence_rejected"):
        assert frame.locator(f"#events tbody tr[data-kind={kind}]").count() >= 1
    assert frame.locator("#advice tbody tr[data-verdict=too_long]", has_text=BROWSER_KEY).count() == 1
    no_horizontal_scroll(frame)
    shoot(page, "leases-1280")
    if readme := os.environ.get("LEASE_UI_SCREENSHOT"):
        readme_picture(browser, world, Path(readme))

    # Filters: only overlap skips.
    frame.locator("select[name=kind]").select_option("skipped_overlap")
    frame.locator("#filters button[type=submit]").click()
    frame.locator("#events tbody tr:not([data-kind=skipped_overlap])").first.wait_for(state="detached")
    # Every overlap skip in the store, and nothing else (other test files of this process may have added
    # some to the session's world: the timeline tests seed a history).
    overlaps = world.store.events.query(kind=EventKind.SKIPPED_OVERLAP, limit=100)
    assert 1 <= frame.locator("#events tbody tr").count() == len(overlaps)

    # Force-release through the confirmation step.
    frame.locator(f"#leases tbody tr[data-key='{BROWSER_KEY}'] button").click()
    go = frame.locator("#confirm-go")
    assert go.is_disabled()
    frame.locator("#confirm-reason").fill("browser test")
    frame.locator("#confirm-typed").fill(BROWSER_KEY[:-1])
    assert go.is_disabled()
    frame.locator("#confirm-typed").fill(BROWSER_KEY)
    assert go.is_enabled()
    shoot_plain(page, "force-release-dialog-1280")
    before = world.store.leases()
    token = next(lease.token for lease in before if lease.key == BROWSER_KEY)
    go.click()
    frame.locator("#flash", has_text="force-released by admin").wait_for()
    assert world.store.holder(BROWSER_KEY) is None
    (event,) = world.store.events.query(key=BROWSER_KEY, kind=EventKind.FORCE_RELEASED)
    assert event.detail["by"] == "admin" and event.detail["new_token"] == token + 1
    assert event.detail["reason"] == "browser test"

    # The force-release reloads the leases table (the row shows the key free): wait for that redraw, or the
    # link below may be clicked on the old table as it is replaced, the click landing on another row's cell
    # (seen once in CI: no navigation, 60 s).
    frame.locator(f"#leases tbody tr.free[data-key='{BROWSER_KEY}']").wait_for()

    # A run link navigates the Airflow UI itself, not the frame.
    frame.locator("#clear-filters").click()
    frame.locator(f"#leases tbody tr[data-key='{LEASE_KEY}'] a", has_text=world.holder_run).click()
    page.wait_for_url(re.compile(rf".*/dags/{DAG_ID}/runs/.*"))
    page.locator("iframe[title=Leases]").wait_for(state="detached")
    page.get_by_text(world.holder_run).first.wait_for()
    page.get_by_role("link", name="publish").first.wait_for()  # the run's task list has loaded
    shoot_plain(page, "run-page-from-link-1280")
    page.close()


def test_narrow_screen(browser: Any, world: World) -> None:
    page = login(browser, world, "viewer", NARROW)
    frame = open_leases_from_nav(page)
    frame.locator("#events tbody tr[data-kind=skipped_overlap]", has_text=LEASE_KEY).wait_for()
    no_horizontal_scroll(frame)
    # A viewer gets no force-release button.
    assert frame.locator("#leases button").count() == 0
    row = frame.locator(f"#leases tbody tr[data-key='{LEASE_KEY}']")
    box = row.bounding_box()
    assert box is not None and box["width"] <= NARROW[0]
    shoot(page, "leases-390")
    page.close()


def test_task_instance_lease_tab(browser: Any, world: World) -> None:
    page = login(browser, world, "viewer")
    run = quote(world.skipped_run, safe="")
    page.goto(f"{world.server.url}/dags/{DAG_ID}/runs/{run}/tasks/publish")
    page.get_by_text("Lease", exact=True).click()  # the tab the plugin adds to every task instance
    page.wait_for_url(re.compile(r".*/tasks/publish/plugin/lease$"))
    frame = page.frame_locator("iframe[title=Lease]")
    # The first line is the recorded skip reason.
    frame.locator("#explain h2", has_text=f"Skipped: lease '{LEASE_KEY}' is held by").wait_for()
    assert world.holder_run in frame.locator("#explain").inner_text()
    assert frame.locator("#events tbody tr").count() == 1
    shoot(page, "task-lease-tab-1280", "iframe[title=Lease]")

    # Airflow's own task instance page does not fit 390 px (it scrolls sideways); the tab's page does.
    page.set_viewport_size({"width": NARROW[0], "height": NARROW[1]})
    page.goto(f"{world.server.url}/lease/ui/task?dag_id={DAG_ID}&run_id={run}&task_id=publish&map_index=-1")
    page.locator("#explain h2", has_text="Skipped: lease").wait_for()
    overflow = page.evaluate("document.documentElement.scrollWidth - document.documentElement.clientWidth")
    assert overflow <= 1
    page.screenshot(path=str(ARTIFACTS / "task-lease-tab-390.png"), full_page=True)
    page.close()


def test_the_page_pages_through_more_leases_than_one_page(browser: Any, world: World) -> None:
    """Past the first page (100 leases) the page offers more, a page at a time, until every key shows."""
    from tests.pg import execute, q

    store = world.store
    bulk = 150
    execute(
        store.db.dsn,
        q(
            "INSERT INTO {schema}.lease (key, owner, token, ttl, acquired_at, renewed_at, expires_at,"
            " dag_id, run_id, task_id, map_index) "
            "SELECT 'zz-page-' || lpad(i::text, 4, '0'), %s || '/page_' || i || '/publish', 1, interval '10 minutes', "
            "clock_timestamp(), clock_timestamp(), clock_timestamp() + interval '10 minutes', "
            "%s, 'page_' || i, 'publish', -1 "  # the run columns, as an acquire with run= writes them
            "FROM generate_series(0, %s) AS i",
            store.schema,
        ),
        (DAG_ID, DAG_ID, bulk - 1),
    )
    page = login(browser, world, "viewer")
    try:
        # What a viewer may see: not the key with no DAG (admins only).
        visible = world.server.request("GET", "/lease/api/leases", "viewer", params={"limit": 1000}).json()
        total = len(visible["leases"])
        assert total > 100 and visible["next_cursor"] is None
        frame = open_leases_from_nav(page)
        rows = frame.locator("#leases tbody tr[data-key]")
        more = frame.locator("#more-leases")
        rows.nth(99).wait_for()
        assert rows.count() == 100 and more.is_visible()
        more.click()
        rows.nth(total - 1).wait_for()
        assert rows.count() == total and more.is_hidden()
        last = frame.locator(f"#leases tbody tr[data-key='zz-page-{bulk - 1:04d}']")
        assert last.count() == 1
    finally:
        page.close()
        execute(store.db.dsn, q("DELETE FROM {schema}.lease WHERE key LIKE 'zz-page-%%'", store.schema))


def test_a_key_with_a_bidi_override_from_an_older_version_is_isolated_and_shown_escaped(
    browser: Any, world: World
) -> None:
    """The store refuses such keys now; a row an older version wrote is still listed, and the page shows
    the override as its code point inside an isolated <bdi dir=auto>, never applying it."""
    key = "00-nightly\u202eesolc"
    execute(
        world.store.db.dsn,
        q("INSERT INTO {schema}.lease (key, owner, token, ttl, acquired_at, renewed_at, expires_at) "
          "VALUES (%s, %s, 1, '1 hour', now(), now(), now() + '1 hour') ON CONFLICT (key) DO NOTHING",
          world.store.schema),
        (key, "old\u202escript"),
    )
    page = login(browser, world, "admin")
    frame = open_leases_from_nav(page)
    row = frame.locator("#leases tbody tr[data-key]").filter(has=frame.locator("td.key", has_text="00-nightly"))
    row.wait_for()
    shown = row.locator("td.key bdi.name[dir=auto]")
    assert shown.count() == 1
    assert shown.locator(".codepoint").inner_text() == "U+202E"
    assert shown.inner_text() == "00-nightlyU+202Eesolc" and "\u202e" not in row.inner_text()
    assert row.locator("bdi.name", has_text="old").inner_text() == "oldU+202Escript"  # the owner too
    # The confirmation sentence isolates the key, so it cannot reorder the words after it.
    row.locator("button").click()
    text = frame.locator("#confirm-text")
    assert text.locator("bdi.name[dir=auto] .codepoint").first.inner_text() == "U+202E"
    assert "\u202e" not in text.inner_text() and "Force-releasing it frees it now." in text.inner_text()
    frame.locator("#confirm-cancel").click()
    page.close()


def test_a_replaced_run_and_a_waiting_run_in_the_browser(browser: Any, world: World) -> None:
    """Issue 26, item 5: the replaced run's Lease tab says which run replaced it; the Leases page shows the
    run that waits for a buffered key; the skipped run's tab names the waiter."""
    seed_policies(world.store)
    old, new, waiter, skipped = policy_run(1), policy_run(2), policy_run(4), policy_run(5)
    page = login(browser, world, "viewer")
    page.goto(f"{world.server.url}/lease/ui/task?dag_id={DAG_ID}&run_id={quote(old.run_id, safe='')}"
              "&task_id=publish&map_index=-1")
    page.locator("#explain h2", has_text="Replaced by a newer run, skipped").wait_for()
    assert new.run_id in page.locator("#replaced-by").inner_text()
    page.goto(f"{world.server.url}/lease/ui/task?dag_id={DAG_ID}&run_id={quote(skipped.run_id, safe='')}"
              "&task_id=publish&map_index=-1")
    page.locator("#explain h2", has_text="Skipped (every waiting place taken)").wait_for()
    assert waiter.run_id in page.locator("#waiting-runs").inner_text()
    page.close()

    page = login(browser, world, "admin")
    frame = open_leases_from_nav(page)
    row = frame.locator(f"#leases tbody tr[data-key='{BUFFER_KEY}']")
    row.locator(".waiting-runs").wait_for()
    assert "1 waiting" in row.inner_text() and waiter.run_id in row.inner_text()
    assert frame.locator("#events tbody tr[data-kind=replaced]").count() >= 1
    page.close()
