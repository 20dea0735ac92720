"""The distillation pages in a real headless Chromium: fleets, the no-worker notice,
metrics as tables, reason lines instead of tracebacks, schedules switched and deleted.

The server, the browser and the helpers are test_ui_browser.py's.
"""

# ruff: noqa: F811  (the imported fixtures are parameters of the tests below)

from __future__ import annotations

from typing import Any

from cloud_service.db import crud
from cloud_service.jobs import queue as jobs
from cloud_service.jobs.tables import Schedule
from cloud_service.jobs.worker import DistillWorker, JobContext, JobOutcome
from tests.cloud_service.test_ui_browser import (  # noqa: F401  (fixtures)
    Site,
    browser,
    pytestmark,
    shot,
    sign_in,
    site,
    wait_for,
)

METRICS = {
    "dataset": {"train": 412, "val": 61, "holdout": 103, "replay": 618},
    "evaluation": {
        "serving": {"holdout": 0.8211, "reference": 0.9012, "drift:blur:1": 0.6011},
        "new_fp32": {"holdout": 0.9001, "reference": 0.9134, "drift:blur:1": 0.7725},
        "new_int8": {"holdout": 0.8993, "reference": 0.9101, "drift:blur:1": 0.7702},
    },
    "gate": {"passed": True, "reasons": [], "gain": 0.0782, "int8_gap": 0.0008},
    "history": [{"epoch": i, "loss": 1.0 / (i + 1)} for i in range(10)],
    "timings": {"snapshot": 0.41, "train": 63.2, "export": 2.9, "quantize": 4.4},
    "registered": "v20261202-1",
    "wall_s": 78.3,
}


def _run_one(site: Site, runner: Any) -> int:
    worker = DistillWorker(site.state.sessions, runner=runner, lease_s=30)
    job_id = worker.run_once()
    assert job_id is not None
    return job_id


def _by_id(driver: Any, element_id: str) -> Any:
    from selenium.webdriver.common.by import By

    return driver.find_element(By.ID, element_id)


def test_a_job_for_a_known_fleet_says_when_no_worker_is_running(browser: Any, site: Site) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver = browser
    with site.state.sessions.begin() as session:  # a fleet known only by its token
        crud.create_enrollment_token(session=session, fleet="plant-3", agent_id=None, ttl_s=3600)
    sign_in(driver, site, "ada")
    driver.get(f"{site.url}/ui/jobs")
    fleets = Select(_by_id(driver, "run-fleet"))
    assert [o.text for o in fleets.options] == ["fleet-a", "fleet-b", "plant-3"]
    _by_id(driver, "job-params").click()  # open the parameter list
    names = [c.text for c in driver.find_elements(By.CSS_SELECTOR, "#job-params td:first-child")]
    assert {"fleet", "epochs", "min_samples", "delivery"} <= set(names)
    fleets.select_by_visible_text("plant-3")
    form = _by_id(driver, "run-now")
    form.find_element(By.NAME, "epochs").send_keys("2")
    form.find_element(By.NAME, "other").send_keys("delivery=none")
    _by_id(driver, "run-job").click()
    wait_for(lambda: "/ui/jobs/" in driver.current_url, what="the new job's page")
    job_id = int(driver.current_url.rsplit("/", 1)[1])
    assert _by_id(driver, "job-fleet").text == "plant-3"
    waiting = _by_id(driver, "job-waiting")
    assert waiting.is_displayed() and "no distill worker is running" in waiting.text
    shot(driver, site, "job-waiting")
    with site.state.sessions() as session:
        assert jobs.get_job(session=session, job_id=job_id).params == {
            "epochs": 2,
            "delivery": "none",
            "fleet": "plant-3",
        }
    driver.get(f"{site.url}/ui/jobs")
    assert "no distill worker is running" in _by_id(driver, "no-worker").text
    assert "no worker" in driver.find_element(By.CSS_SELECTOR, "#jobs tbody tr").text

    # A worker registers: the job's page, polling, drops the notice.
    with site.state.sessions.begin() as session:
        jobs.beat_worker(session=session, owner="w-browser", host="h", pid=1, ttl_s=300)
    try:
        driver.get(f"{site.url}/ui/jobs/{job_id}")
        wait_for(lambda: not _by_id(driver, "job-waiting").is_displayed(), what="notice gone")
        driver.get(f"{site.url}/ui/jobs")
        assert not driver.find_elements(By.ID, "no-worker")
    finally:
        with site.state.sessions.begin() as session:
            jobs.remove_worker(session=session, owner="w-browser")
            jobs.cancel(session=session, job_id=job_id)


def test_job_metrics_are_tables_and_a_failure_is_one_reason_line(browser: Any, site: Site) -> None:
    from selenium.webdriver.common.by import By

    driver = browser
    with site.state.sessions.begin() as session:
        jobs.enqueue(session=session, params={"fleet": "fleet-a"}, priority=0)
    done = _run_one(site, lambda ctx: JobOutcome(metrics=METRICS, result_version="v1"))

    def boom(ctx: JobContext) -> JobOutcome:
        raise ValueError("the holdout set is empty")

    with site.state.sessions.begin() as session:
        jobs.enqueue(session=session, params={"fleet": "fleet-a"}, priority=0)
    failed = _run_one(site, boom)

    sign_in(driver, site, "ada")
    driver.get(f"{site.url}/ui/jobs/{done}")
    wait_for(lambda: driver.find_elements(By.CSS_SELECTOR, "table.metrics"), what="tables")
    # Read in one script: the page may draw its tables again between two WebDriver calls.
    tables = driver.execute_script(
        """return [...document.querySelectorAll('table.metrics')].map(t => ({
            caption: t.caption ? t.caption.innerText : '',
            header: [...t.querySelectorAll('th')].map(th => th.innerText),
            rows: [...t.querySelectorAll('tbody tr')].map(
                tr => [...tr.querySelectorAll('td')].map(td => td.innerText)),
        }))"""
    )
    captions = [t["caption"] for t in tables]
    assert captions[:2] == ["Summary", "Evaluation (top-1, %)"]
    assert {"Dataset", "Gate", "Timings"} <= set(captions)
    evaluation = tables[1]
    assert evaluation["header"] == ["model", "holdout", "reference", "drift:blur:1"]
    assert evaluation["rows"][0] == ["serving", "82.1", "90.1", "60.1"]
    # Nothing runs off the page: no horizontal scroll, however long the metrics.
    assert driver.execute_script(
        "return document.documentElement.scrollWidth <= document.documentElement.clientWidth"
    )
    assert "{" not in _by_id(driver, "job-metrics").text
    shot(driver, site, "job-metrics")

    driver.get(f"{site.url}/ui/jobs/{failed}")
    log = wait_for(lambda: _by_id(driver, "job-log").text, what="the log")
    assert "failed: ValueError: the holdout set is empty" in log
    assert "Traceback" not in log and 'File "' not in log
    assert _by_id(driver, "job-error").text == "ValueError: the holdout set is empty"


def test_schedules_are_created_for_a_fleet_switched_and_deleted(browser: Any, site: Site) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver = browser
    sign_in(driver, site, "ada")
    driver.get(f"{site.url}/ui/jobs")
    form = _by_id(driver, "new-schedule")
    _by_id(driver, "schedule-name").send_keys("nightly-b")
    Select(_by_id(driver, "schedule-fleet")).select_by_visible_text("fleet-b")
    Select(_by_id(driver, "schedule-kind")).select_by_visible_text("cron")
    _by_id(driver, "schedule-expression").send_keys("0 3 * * *")
    form.find_element(By.NAME, "epochs").send_keys("4")
    _by_id(driver, "create-schedule").click()
    wait_for(lambda: "schedule nightly-b created" in driver.page_source, what="the notice")
    with site.state.sessions() as session:
        schedule = session.query(Schedule).filter_by(name="nightly-b").one()
        assert schedule.params == {"epochs": 4, "fleet": "fleet-b"} and schedule.enabled

    def row() -> Any:
        return driver.find_element(By.CSS_SELECTOR, f'tr[data-schedule="{schedule.id}"]')

    def shown_enabled() -> str:
        # The toggle reloads the page: until the new page is in, the row may be
        # the old one, gone stale, or not there yet. Read it again until it settles.
        from selenium.common.exceptions import (
            NoSuchElementException,
            StaleElementReferenceException,
        )

        try:
            return str(row().find_element(By.CLASS_NAME, "enabled").text)
        except (NoSuchElementException, StaleElementReferenceException):
            return ""

    assert "fleet-b" in row().text and shown_enabled() == "yes"
    row().find_element(By.CLASS_NAME, "toggle-schedule").click()
    wait_for(lambda: shown_enabled() == "no", what="the row shown disabled")
    row().find_element(By.CLASS_NAME, "toggle-schedule").click()
    wait_for(lambda: shown_enabled() == "yes", what="the row shown enabled")
    row().find_element(By.CLASS_NAME, "delete-schedule").click()
    driver.switch_to.alert.dismiss()  # asked first; "no" keeps it
    assert row().find_element(By.CLASS_NAME, "enabled").text == "yes"
    row().find_element(By.CLASS_NAME, "delete-schedule").click()
    driver.switch_to.alert.accept()
    wait_for(lambda: "schedule nightly-b deleted" in driver.page_source, what="deleted")
    assert not driver.find_elements(By.CSS_SELECTOR, f'tr[data-schedule="{schedule.id}"]')
    with site.state.sessions() as session:
        assert session.get(Schedule, schedule.id) is None
