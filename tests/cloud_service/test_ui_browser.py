"""The review UI in a real headless Chromium (Debian's), driven by Selenium.

A uvicorn server runs the app in a thread on a free loopback port over a seeded
SQLite database. Screenshots go to $EDGELOOP_TEST_ARTIFACTS (else the test's temp
folder); with EDGELOOP_UPDATE_SCREENSHOTS=1 they are also copied to docs/screenshots/.
"""

from __future__ import annotations

import csv
import io
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from cloud_service.api import create_app
from cloud_service.db import crud
from cloud_service.db.models import Label, Sample
from cloud_service.settings import CloudSettings
from cloud_service.ui.seed import seed
from shared.broker import free_port

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
REPO = Path(__file__).resolve().parents[2]
PASSWORD = "correct horse battery"

pytestmark = pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason="Debian's chromium and chromedriver are not installed (make test installs them)",
)


@dataclass
class Site:
    url: str
    state: Any
    seeded: dict[str, Any]
    artifacts: Path


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, teacher_path: Path) -> Iterator[Site]:
    import uvicorn

    root = tmp_path_factory.mktemp("ui-browser")
    settings = CloudSettings(
        data_dir=root / "data",
        database_url=f"sqlite:///{root / 'ui.db'}",
        teacher_model=teacher_path,
        blob_fsync=False,
        rollout_tick_s=0,
    )
    app = create_app(settings)
    state = app.state.edgeloop
    with state.sessions.begin() as session:
        crud.create_user(session=session, username="ada", password=PASSWORD, role="admin")
        crud.create_user(session=session, username="rev", password=PASSWORD, role="reviewer")
        seeded = seed(session=session, blobs=state.blobs, samples=120, agents=4, images=12)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    )
    thread = threading.Thread(target=server.run, name="ui-server", daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the UI server did not start")
        time.sleep(0.05)
    folder = os.environ.get("EDGELOOP_TEST_ARTIFACTS")
    artifacts = Path(folder) if folder else root / "artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    yield Site(f"http://127.0.0.1:{port}", state, seeded, artifacts)
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def browser(site: Site, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tmp_path_factory.mktemp("chromium-profile")
    downloads = site.artifacts / "downloads"
    downloads.mkdir(exist_ok=True)
    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        "--disable-dev-shm-usage",
        f"--user-data-dir={profile}",
        "--window-size=1400,950",
    ):
        options.add_argument(flag)
    options.add_experimental_option(
        "prefs",
        {"download.default_directory": str(downloads), "download.prompt_for_download": False},
    )
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    driver.execute_cdp_cmd(
        "Page.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)}
    )
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def wait_for(predicate: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.03)
    raise AssertionError(f"timed out waiting for {what}")


def shot(driver: Any, site: Site, name: str) -> None:
    path = site.artifacts / f"{name}.png"
    driver.save_screenshot(str(path))
    # Refreshing the README's screenshots is a deliberate act, not a side effect
    # of every test run: EDGELOOP_UPDATE_SCREENSHOTS=1 copies them to docs/.
    if os.environ.get("EDGELOOP_UPDATE_SCREENSHOTS") == "1":
        docs = REPO / "docs" / "screenshots"
        docs.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, docs / f"{name}.png")


def sign_in(driver: Any, site: Site, username: str) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver.delete_all_cookies()
    driver.get(f"{site.url}/ui/login")
    # Keys only: type the user, Tab to the password, Enter submits.
    field = wait_for(lambda: driver.find_elements(By.ID, "username"), what="the login form")[0]
    field.send_keys(username, Keys.TAB, PASSWORD, Keys.ENTER)
    wait_for(lambda: "/ui/queue" in driver.current_url, what="the queue after sign-in")
    assert driver.find_element(By.CSS_SELECTOR, ".who").text.startswith(username)


def shown(driver: Any) -> str:
    return str(driver.execute_script("return document.body.dataset.shown || ''"))


def press(driver: Any, *keys: str) -> None:
    from selenium.webdriver.common.action_chains import ActionChains

    ActionChains(driver).send_keys(*keys).perform()


def sample_state(site: Site, sample_id: str) -> tuple[str, list[tuple[int, str]]]:
    with site.state.sessions() as session:
        sample = session.get(Sample, sample_id)
        labels = session.query(Label).filter(Label.sample_id == sample_id).order_by(Label.id)
        return sample.status, [(label.label, label.labeled_by) for label in labels]


def test_review_with_the_keyboard_only(browser: Any, site: Site) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver = browser
    sign_in(driver, site, "rev")
    shot(driver, site, "queue")
    flagged = site.seeded["flagged"]
    press(driver, Keys.ENTER)  # opens the row under the cursor: the newest flagged sample
    wait_for(lambda: shown(driver) == flagged[0], what="the first sample")
    shot(driver, site, "review")

    press(driver, "3", Keys.ENTER)  # pick "dog", confirm: the next sample shows in place
    wait_for(lambda: shown(driver) == flagged[1], what="the second sample")
    assert sample_state(site, flagged[0]) == ("reviewed", [(3, "rev")])
    press(driver, "x")  # discard
    wait_for(lambda: shown(driver) == flagged[2], what="the third sample")
    assert sample_state(site, flagged[1])[0] == "discarded"
    press(driver, "u")  # undo the discard: the second sample comes back, flagged again
    wait_for(lambda: shown(driver) == flagged[1], what="the undone sample")
    assert sample_state(site, flagged[1]) == ("flagged", [])
    press(driver, "j")
    wait_for(lambda: shown(driver) == flagged[2], what="J to the next sample")
    press(driver, "k")
    wait_for(lambda: shown(driver) == flagged[1], what="K back")
    press(driver, Keys.ARROW_RIGHT)
    wait_for(lambda: shown(driver) == flagged[2], what="the right arrow")
    for expected in flagged[3:8]:  # a quick run of confirmations, for the timings
        press(driver, Keys.ENTER)
        wait_for(lambda e=expected: shown(driver) == e, what="the next sample")  # type: ignore[misc]
    assert sample_state(site, flagged[2])[0] == "reviewed"

    # Someone else reviews the sample on screen meanwhile: reported, not overwritten.
    current = flagged[7]
    with site.state.sessions.begin() as session:
        crud.add_label(session=session, sample_id=current, label=1, labeled_by="ada")
    press(driver, "5", Keys.ENTER)
    message = wait_for(
        lambda: (
            "changed meanwhile" in driver.find_element(By.ID, "message").text
            and driver.find_element(By.ID, "message").text
        ),
        what="the conflict message",
    )
    assert "by ada" in message
    assert sample_state(site, current) == ("reviewed", [(1, "ada")])
    shot(driver, site, "review-conflict")

    timings = driver.execute_script("return window.edgeloopTimings")
    assert timings and len(timings) >= 8
    (site.artifacts / "review-timings.json").write_text(json.dumps(timings))
    ordered = sorted(timings)
    print(f"key press to next image: median {ordered[len(ordered) // 2]:.1f} ms, n={len(timings)}")


def test_bulk_relabel_and_export(browser: Any, site: Site) -> None:
    from selenium.webdriver.common.by import By

    driver = browser
    sign_in(driver, site, "rev")
    driver.get(f"{site.url}/ui/queue?status=flagged&agent=cam-2")
    rows = driver.find_elements(By.CSS_SELECTOR, "tr.row")
    ids = [row.get_attribute("data-id") for row in rows[:3]]
    for row in rows[:3]:
        row.find_element(By.CSS_SELECTOR, "input.pick").click()
    driver.find_element(By.ID, "bulk-label").send_keys("6")
    driver.find_element(By.ID, "bulk-relabel").click()
    notice = wait_for(
        lambda: driver.find_elements(By.CSS_SELECTOR, ".notice"), what="the bulk notice"
    )
    assert "relabel: 3 done" in notice[0].text
    assert "agent=cam-2" in driver.current_url  # the filter survives the action
    for sample_id in ids:
        assert sample_state(site, sample_id) == ("reviewed", [(6, "rev")])
    shot(driver, site, "queue-after-bulk")

    downloads = site.artifacts / "downloads"
    for old in downloads.glob("*"):
        old.unlink()
    driver.get(f"{site.url}/ui/queue?status=reviewed&agent=cam-2")
    driver.find_element(By.ID, "export-csv").click()
    done = wait_for(
        lambda: [p for p in downloads.glob("*.csv") if not p.name.endswith(".crdownload")],
        what="the CSV download",
    )
    lines = done[0].read_text().splitlines()
    assert lines[0].startswith("sample_id,label,class_name")
    exported = {line.split(",")[0]: line for line in lines[1:]}
    assert set(ids) <= set(exported)  # (the keyboard test reviewed some of cam-2's too)
    assert all(",bird,human,rev," in exported[sample_id] for sample_id in ids)


def test_pages_and_a_reviewer_denied_an_admin_page(browser: Any, site: Site) -> None:
    from selenium.webdriver.common.by import By

    driver = browser
    sign_in(driver, site, "ada")
    for name in ("dashboard", "agents", "models"):
        driver.get(f"{site.url}/ui/{name}")
        wait_for(lambda: driver.find_elements(By.TAG_NAME, "main"), what=name)
        shot(driver, site, name)
        if name == "dashboard":
            assert len(driver.find_elements(By.CSS_SELECTOR, "svg.chart")) == 4
    sign_in(driver, site, "rev")
    driver.get(f"{site.url}/ui/users")
    text = driver.find_element(By.ID, "error-message").text
    assert "needs an admin" in text
    assert "Users" not in driver.find_element(By.CSS_SELECTOR, "header nav").text
    shot(driver, site, "reviewer-denied")
    driver.delete_all_cookies()
    driver.get(f"{site.url}/ui/queue")
    wait_for(lambda: "/ui/login" in driver.current_url, what="the login page")


def test_schedule_run_and_watch_a_job(browser: Any, site: Site) -> None:
    from selenium.webdriver.common.by import By

    from cloud_service.jobs import queue as jobs

    driver = browser
    sign_in(driver, site, "ada")
    driver.get(f"{site.url}/ui/jobs")
    driver.find_element(By.ID, "schedule-name").send_keys("nightly")
    driver.find_element(By.ID, "schedule-expression").send_keys("86400")
    driver.find_element(By.ID, "create-schedule").click()
    wait_for(lambda: "schedule nightly created" in driver.page_source, what="the schedule")
    assert "nightly" in driver.find_element(By.ID, "schedules").text
    driver.find_element(By.CSS_SELECTOR, "#run-now input[name=epochs]").send_keys("3")
    driver.find_element(By.ID, "run-job").click()
    wait_for(lambda: "/ui/jobs/" in driver.current_url, what="the job page")
    job_id = int(driver.current_url.rsplit("/", 1)[1])
    wait_for(lambda: driver.find_element(By.ID, "job-state").text == "queued", what="queued")

    # A worker takes the job and reports progress; the page follows without reloading.
    with site.state.sessions.begin() as session:
        claimed = jobs.claim(session=session, owner="test-worker", lease_s=60)
        assert claimed is not None and claimed.id == job_id
    with site.state.sessions.begin() as session:
        jobs.renew(
            session=session, job_id=job_id, owner="test-worker", lease_s=60, phase="train",
            percent=42.0, eta_s=90.0,
        )  # fmt: skip
        jobs.append_log(session=session, job_id=job_id, message="epoch 1/3 loss 0.731")
    wait_for(lambda: driver.find_element(By.ID, "job-percent").text == "42%", what="live progress")
    wait_for(lambda: "epoch 1/3" in driver.find_element(By.ID, "job-log").text, what="the log")
    wait_for(lambda: driver.find_element(By.ID, "job-phase").text == "train", what="the phase")
    shot(driver, site, "job")
    driver.find_element(By.ID, "cancel-job").click()
    wait_for(
        lambda: "cancel requested" in driver.find_element(By.ID, "job-state").text,
        what="the cancel request",
    )
    with site.state.sessions() as session:
        assert jobs.get_job(session=session, job_id=job_id).cancel_requested
    driver.get(f"{site.url}/ui/jobs")
    shot(driver, site, "jobs")


def _downloaded(site: Site, pattern: str) -> Path:
    downloads = site.artifacts / "downloads"
    found = wait_for(
        lambda: [p for p in downloads.glob(pattern) if not p.name.endswith(".crdownload")],
        what=f"the {pattern} download",
    )
    return Path(found[0])


def _clear_downloads(site: Site) -> None:
    for old in (site.artifacts / "downloads").glob("*"):
        old.unlink()


def test_agents_page_with_idle_and_stopped_agents(browser: Any, site: Site) -> None:
    from datetime import UTC, datetime, timedelta

    from selenium.webdriver.common.by import By

    from shared.messages import AgentStatus

    now = datetime.now(UTC)
    with site.state.sessions.begin() as session:
        for agent, state, sent_at in [
            ("cam-stopped", "offline", now),  # a last will: no figures at all
            ("cam-idle", "online", now - timedelta(minutes=30)),  # heartbeats stopped
        ]:
            status = AgentStatus(fleet="fleet-a", agent=agent, state=state, sent_at=sent_at)
            crud.record_agent_status(session=session, status=status)
    driver = browser
    sign_in(driver, site, "ada")
    driver.get(f"{site.url}/ui/agents")
    table = wait_for(lambda: driver.find_elements(By.ID, "agents"), what="the agents table")[0]
    rows = {
        row.find_element(By.TAG_NAME, "a").text: row.text
        for row in table.find_elements(By.CSS_SELECTOR, "tbody tr")
    }
    assert "offline" in rows["cam-stopped"] and "stale" in rows["cam-idle"]
    assert "online" in rows["cam-1"]
    shot(driver, site, "agents-idle-stopped")


def test_class_names_in_the_review_page_and_filters(browser: Any, site: Site) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    from cloud_service.ui.seed import CLASSES

    driver = browser
    sign_in(driver, site, "rev")
    field = driver.find_element(By.ID, "edge-class")
    field.send_keys("dog", Keys.ENTER)  # a class name, not its index
    wait_for(lambda: "edge_class=dog" in driver.current_url, what="the filtered queue")
    rows = driver.find_elements(By.CSS_SELECTOR, "tr.row")
    assert rows and all(r.find_elements(By.TAG_NAME, "td")[2].text.startswith("dog") for r in rows)
    rows[0].find_element(By.CSS_SELECTOR, "a").click()
    wait_for(lambda: shown(driver) not in ("", "end"), what="the review page")
    buttons = [b.text for b in driver.find_elements(By.CSS_SELECTOR, "#choices button")]
    assert buttons == [f"{i}{name}" for i, name in enumerate(CLASSES)]  # the key, then the name
    assert driver.find_element(By.ID, "edge-summary").text.startswith("dog ")
    bars = driver.find_elements(By.CSS_SELECTOR, "#edge-bars .name")
    assert [b.text for b in bars] == buttons
    shot(driver, site, "review-class-names")


def test_an_invalid_filter_shows_the_error_page(browser: Any, site: Site) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver = browser
    sign_in(driver, site, "rev")
    driver.get(f"{site.url}/ui/queue?agent=cam-3")
    driver.find_element(By.ID, "edge-class").send_keys("unicorn", Keys.ENTER)
    message = wait_for(lambda: driver.find_elements(By.ID, "error-message"), what="the error page")[
        0
    ].text
    assert "'unicorn' is neither a class name nor a class index" in message
    assert "known classes: person, bicycle" in message
    assert "{" not in driver.find_element(By.TAG_NAME, "body").text  # a page, not JSON
    shot(driver, site, "error-invalid-filter")
    driver.find_element(By.ID, "error-back").click()
    wait_for(lambda: driver.current_url.endswith("/ui/queue?agent=cam-3"), what="back")


def test_bulk_discard_is_confirmed_and_undone(browser: Any, site: Site) -> None:
    from selenium.webdriver.common.by import By

    driver = browser
    sign_in(driver, site, "rev")
    driver.get(f"{site.url}/ui/queue?status=flagged&agent=cam-4")
    rows = driver.find_elements(By.CSS_SELECTOR, "tr.row")[:3]
    ids = [row.get_attribute("data-id") for row in rows]
    assert len(ids) == 3
    for row in rows:
        row.find_element(By.CSS_SELECTOR, "input.pick").click()
    driver.find_element(By.ID, "bulk-discard").click()
    title = wait_for(lambda: driver.find_elements(By.TAG_NAME, "h1"), what="the question")[0]
    assert title.text == "Discard 3 samples?"
    assert all(sample_state(site, i)[0] == "flagged" for i in ids)  # asked, nothing done
    shot(driver, site, "bulk-discard-confirm")
    driver.find_element(By.ID, "confirm-discard-button").click()
    notice = wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, ".notice"), what="notice")
    assert "discard: 3 done" in notice[0].text and "agent=cam-4" in driver.current_url
    assert all(sample_state(site, i)[0] == "discarded" for i in ids)
    shot(driver, site, "bulk-discard-undo")
    driver.find_element(By.ID, "undo-bulk-button").click()
    wait_for(lambda: "undo: 3 samples restored" in driver.page_source, what="the undo notice")
    assert all(sample_state(site, i) == ("flagged", []) for i in ids)
    assert not driver.find_elements(By.ID, "undo-bulk-button")  # one undo per discard


def test_export_follows_the_status_filter(browser: Any, site: Site) -> None:
    from pycocotools.coco import COCO
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver = browser
    sign_in(driver, site, "rev")
    Select(driver.find_element(By.NAME, "status")).select_by_visible_text("verified")
    Select(driver.find_element(By.NAME, "agent")).select_by_visible_text("cam-1")
    driver.find_element(By.ID, "apply-filters").click()
    wait_for(lambda: "status=verified" in driver.current_url, what="the filtered queue")
    shown_ids = {
        r.get_attribute("data-id") for r in driver.find_elements(By.CSS_SELECTOR, "tr.row")
    }
    _clear_downloads(site)
    driver.find_element(By.ID, "export-csv").click()
    rows = list(csv.DictReader(io.StringIO(_downloaded(site, "*.csv").read_text())))
    assert {r["status"] for r in rows} == {"verified"} and {r["agent_id"] for r in rows} == {
        "cam-1"
    }
    assert {r["sample_id"] for r in rows} >= shown_ids
    _clear_downloads(site)
    driver.find_element(By.ID, "export-coco").click()
    coco = COCO(str(_downloaded(site, "*.json")))
    assert {img["sample_id"] for img in coco.loadImgs(coco.getImgIds())} == {
        r["sample_id"] for r in rows
    }
