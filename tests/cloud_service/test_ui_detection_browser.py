"""Reviewing detection samples in a real headless Chromium (Debian's), driven by Selenium.

A uvicorn server runs the app in a thread on a socket bound before it starts (the
browser's first request waits in its backlog), over a SQLite database seeded with the
conveyor-belt frames of ``cloud_service.ui.seed.seed_detection``. Every wait is a
WebDriverWait on the page's state. With EDGELOOP_SCREENSHOTS=1 the screenshots are
written to docs/screenshots/review-detection-*.png; otherwise to the test's temp folder.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from cloud_service.api import create_app
from cloud_service.db import crud
from cloud_service.db.models import Label, Sample
from cloud_service.settings import CloudSettings
from cloud_service.ui.seed import DETECTION_FRAMES, seed_detection

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
REPO = Path(__file__).resolve().parents[2]
PASSWORD = "correct horse battery"
QUERY = "status=flagged&agent=belt-1"
TOLERANCE = 0.01  # a drawn corner's fraction, against the pixels the mouse went to

pytestmark = pytest.mark.skipif(
    not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
    reason="Debian's chromium and chromedriver are not installed (make test installs them)",
)


@dataclass
class Site:
    url: str
    state: Any
    frames: list[str]  # the detection samples, in DETECTION_FRAMES' order (newest first)
    artifacts: Path


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory, teacher_path: Path) -> Iterator[Site]:
    import uvicorn

    root = tmp_path_factory.mktemp("ui-detection")
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
        crud.create_user(session=session, username="rev", password=PASSWORD, role="reviewer")
        seeded = seed_detection(session=session, blobs=state.blobs)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    port = listener.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [listener]}, name="ui-server", daemon=True
    )
    thread.start()
    artifacts = root / "artifacts"
    artifacts.mkdir()
    yield Site(f"http://127.0.0.1:{port}", state, seeded["detection"], artifacts)
    server.should_exit = True
    thread.join(10)
    listener.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tmp_path_factory.mktemp("chromium-profile")
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
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def wait(driver: Any, condition: Callable[[Any], Any], what: str, timeout: float = 15) -> Any:
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout).until(condition, message=f"waiting for {what}")


def shot(driver: Any, site: Site, name: str) -> None:
    """A screenshot; into the repository's docs only when EDGELOOP_SCREENSHOTS=1."""
    if os.environ.get("EDGELOOP_SCREENSHOTS") == "1":
        folder = REPO / "docs" / "screenshots"
        folder.mkdir(parents=True, exist_ok=True)
    else:
        folder = site.artifacts
    driver.save_screenshot(str(folder / f"review-detection-{name}.png"))


def press(driver: Any, *keys: str, shift: bool = False) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    chain = ActionChains(driver)
    if shift:
        chain = chain.key_down(Keys.SHIFT)
    chain = chain.send_keys(*keys)
    if shift:
        chain = chain.key_up(Keys.SHIFT)
    chain.perform()


def sign_in(driver: Any, site: Site) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver.delete_all_cookies()
    driver.get(f"{site.url}/ui/login")
    field = wait(driver, lambda d: d.find_elements(By.ID, "username"), "the login form")[0]
    field.send_keys("rev", Keys.TAB, PASSWORD, Keys.ENTER)
    wait(driver, lambda d: "/ui/queue" in d.current_url, "the queue after sign-in")


def open_sample(driver: Any, site: Site, index: int) -> str:
    sample_id = site.frames[index]
    driver.get(f"{site.url}/ui/review/{sample_id}?{QUERY}")
    wait(driver, lambda d: shown(d) == sample_id, f"frame {index} on screen")
    return sample_id


def shown(driver: Any) -> str:
    return str(driver.execute_script("return document.body.dataset.shown || ''"))


def editor_state(driver: Any) -> dict[str, Any]:
    """The working label as the page holds it, and the selected box (-1: none)."""
    data = driver.execute_script(
        "const s = document.getElementById('boxes');"
        "return [s.dataset.work || '[]', s.dataset.selected || '-1'];"
    )
    return {"work": json.loads(data[0]), "selected": int(data[1])}


def until_work(driver: Any, check: Callable[[list[list[float]]], bool], what: str) -> Any:
    return wait(driver, lambda d: check(editor_state(d)["work"]) and editor_state(d), what)


def stored(site: Site, sample_id: str) -> tuple[str, list[tuple[int, Any, str]]]:
    with site.state.sessions() as session:
        sample = session.get(Sample, sample_id)
        query = select(Label).where(Label.sample_id == sample_id).order_by(Label.id)
        labels = [(lb.label, lb.boxes, lb.labeled_by) for lb in session.scalars(query)]
        return sample.status, labels


def rows(boxes: Sequence[Sequence[float]]) -> list[list[float]]:
    """Answer boxes as the page's working label: corners and class."""
    return [[*b[:4], b[5]] for b in boxes]


def test_both_answers_are_drawn_and_only_the_differences_stand_out(
    browser: Any, site: Site
) -> None:
    from selenium.webdriver.common.by import By

    driver = browser
    sign_in(driver, site)
    open_sample(driver, site, 0)
    teacher, edge = DETECTION_FRAMES[0]
    boxes = wait(
        driver, lambda d: d.find_elements(By.CSS_SELECTOR, "#boxes rect.box"), "the boxes drawn"
    )

    def drawn(layer: str, strength: str = "") -> set[int]:
        return {
            int(r.get_attribute("data-index"))
            for r in boxes
            if r.get_attribute("data-layer") == layer
            and (not strength or strength in r.get_attribute("class").split())
        }

    assert drawn("edge") == set(range(len(edge))) and drawn("teacher") == set(range(len(teacher)))
    # Box 0 matches on both sides; the others differ: wrong class, loose, missed / extra.
    assert drawn("teacher", "strong") == {1, 2, 3} and drawn("edge", "strong") == {1, 2, 3}
    assert drawn("teacher", "faint") == {0} and drawn("edge", "faint") == {0}
    statuses = {
        (r.get_attribute("data-layer"), r.get_attribute("data-status"))
        for r in boxes
        if "strong" in r.get_attribute("class").split()
    }
    assert statuses == {
        ("teacher", "wrong_class"), ("teacher", "localisation"), ("teacher", "missed"),
        ("edge", "wrong_class"), ("edge", "localisation"), ("edge", "extra"),
    }  # fmt: skip
    assert editor_state(driver)["work"] == rows(teacher)  # the label starts as the teacher's

    # Distinct styles, and the faint ones really are faint.
    style = driver.execute_script(
        "const pick = s => getComputedStyle(document.querySelector(s));"
        "const e = pick('rect.edge.strong'), t = pick('rect.teacher.strong'),"
        "  f = pick('rect.teacher.faint'), w = pick('rect.work');"
        "return [e.stroke, e.strokeDasharray, t.stroke, t.strokeDasharray, f.opacity, w.stroke];"
    )
    assert style[0] == "rgb(249, 115, 22)" and style[1] not in ("none", "")
    assert style[2] == "rgb(37, 99, 235)" and style[3] in ("none", "")
    assert float(style[4]) < 0.5 and style[5] == "rgb(22, 163, 74)"
    # Boxes sit where their fractions say, on the frame as displayed.
    placed = driver.execute_script(
        "const s = document.getElementById('boxes').getBoundingClientRect();"
        "const r = document.querySelector('rect.teacher[data-index=\"3\"]')"
        "  .getBoundingClientRect();"
        "return [(r.left - s.left) / s.width, (r.top - s.top) / s.height,"
        "  (r.right - s.left) / s.width, (r.bottom - s.top) / s.height];"
    )
    assert placed == pytest.approx(teacher[3][:4], abs=TOLERANCE)
    labels = [t.text for t in driver.find_elements(By.CSS_SELECTOR, "#boxes text")]
    assert "T 5 · missed" in labels and "E 9 0.41 · extra" in labels
    assert "T 7 · wrong class" in labels and "E 2 0.62 · wrong class" in labels
    assert driver.find_element(By.ID, "diff-summary").text == (
        "Differences: 1 missed, 1 extra, 1 wrong class, 1 loose."
    )
    assert not driver.find_element(By.ID, "choices").is_displayed()  # classification's panel
    assert driver.find_element(By.ID, "legend").is_displayed()
    shot(driver, site, "differences")


def test_keyboard_edit_confirm_and_undo(browser: Any, site: Site) -> None:
    from selenium.webdriver.common.keys import Keys

    driver = browser
    sign_in(driver, site)
    first = open_sample(driver, site, 0)
    teacher = rows(DETECTION_FRAMES[0][0])
    press(driver, Keys.TAB)
    wait(driver, lambda d: editor_state(d)["selected"] == 0, "Tab selecting the first box")
    press(driver, Keys.TAB, Keys.TAB)
    press(driver, Keys.TAB, shift=True)
    wait(driver, lambda d: editor_state(d)["selected"] == 1, "Shift+Tab back to box 1")
    press(driver, "2")  # the teacher said 7, the edge 2: the reviewer sides with the edge
    until_work(driver, lambda w: w[1][4] == 2, "the digit changing the class")
    press(driver, Keys.TAB, Keys.TAB)
    wait(driver, lambda d: editor_state(d)["selected"] == 3, "the fourth box selected")
    press(driver, Keys.DELETE)
    until_work(driver, lambda w: len(w) == 3, "Delete removing the box")
    press(driver, "u")  # the page's own edit history first
    state = until_work(driver, lambda w: len(w) == 4, "U restoring the deleted box")
    assert state["work"][1][4] == 2 and state["selected"] == 3  # only the delete undone
    press(driver, Keys.BACK_SPACE)
    until_work(driver, lambda w: len(w) == 3, "Backspace removing it again")
    shot(driver, site, "edited")

    press(driver, Keys.ENTER)
    wait(driver, lambda d: shown(d) == site.frames[1], "the next frame after Enter")
    expected = [teacher[0], [*teacher[1][:4], 2], teacher[2]]
    status, labels = stored(site, first)
    assert status == "reviewed"
    assert labels == [(3, [[*b[:4], 1.0, b[4]] for b in expected], "rev")]

    press(driver, "u")  # nothing edited here: the confirmation is taken back
    wait(driver, lambda d: shown(d) == first, "the undone frame again")
    assert stored(site, first) == ("flagged", [])
    until_work(driver, lambda w: w == teacher, "the teacher's boxes again")


def test_drawing_a_missing_box_with_the_mouse(browser: Any, site: Site) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver = browser
    sign_in(driver, site)
    sample_id = open_sample(driver, site, 2)  # the edge saw nothing; the teacher one 6
    teacher = rows(DETECTION_FRAMES[2][0])
    until_work(driver, lambda w: w == teacher, "the teacher's box")
    press(driver, "e")
    until_work(driver, lambda w: w == [], "E taking the edge's (no) boxes")
    press(driver, "t")
    until_work(driver, lambda w: w == teacher, "T taking the teacher's box")
    press(driver, "u")
    until_work(driver, lambda w: w == [], "U undoing T")
    press(driver, "T")
    until_work(driver, lambda w: w == teacher, "T again")

    svg = driver.find_element(By.ID, "boxes")
    width, height = driver.execute_script(
        "const r = arguments[0].getBoundingClientRect(); return [r.width, r.height];", svg
    )
    start, end = (0.08, 0.12), (0.30, 0.45)
    x0, y0 = round(start[0] * width), round(start[1] * height)
    x1, y1 = round(end[0] * width), round(end[1] * height)
    (
        ActionChains(driver)
        .move_to_element_with_offset(svg, x0 - int(width / 2), y0 - int(height / 2))
        .click_and_hold()
        .move_by_offset(x1 - x0, y1 - y0)
        .release()
        .perform()
    )
    state = until_work(driver, lambda w: len(w) == 2, "the drawn box")
    drawn = state["work"][1]
    assert drawn[:4] == pytest.approx([*start, *end], abs=TOLERANCE)
    assert drawn[4] == 6 and state["selected"] == 1  # the last class used; selected
    press(driver, "4")
    until_work(driver, lambda w: w[1][4] == 4, "the drawn box's class")
    shot(driver, site, "drawn")
    press(driver, Keys.ENTER)
    wait(driver, lambda d: shown(d) == site.frames[3], "the next frame")
    status, labels = stored(site, sample_id)
    assert status == "reviewed" and len(labels) == 1
    label, boxes, _ = labels[0]
    assert label == 6 and boxes[0] == [*teacher[0][:4], 1.0, 6]
    assert boxes[1][:4] == pytest.approx(drawn[:4], abs=1e-4) and boxes[1][4:] == [1.0, 4]


def test_moving_and_resizing_a_box_with_the_mouse_and_the_arrows(browser: Any, site: Site) -> None:
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys

    driver = browser
    sign_in(driver, site)
    sample_id = open_sample(driver, site, 2)
    teacher = rows(DETECTION_FRAMES[2][0])  # one 6 at (0.40, 0.30) - (0.62, 0.62)
    press(driver, "t")  # whatever an earlier review left: the teacher's box
    until_work(driver, lambda w: w == teacher, "the teacher's box")
    svg = driver.find_element(By.ID, "boxes")
    width, height = driver.execute_script(
        "const r = arguments[0].getBoundingClientRect(); return [r.width, r.height];", svg
    )

    def drag(start: tuple[float, float], by: tuple[float, float]) -> None:
        x0, y0 = round(start[0] * width), round(start[1] * height)
        (
            ActionChains(driver)
            .move_to_element_with_offset(svg, x0 - int(width / 2), y0 - int(height / 2))
            .click_and_hold()
            .move_by_offset(round(by[0] * width), round(by[1] * height))
            .release()
            .perform()
        )

    drag((0.51, 0.46), (0.10, 0.05))  # from inside the box: it moves, same size
    moved = until_work(driver, lambda w: w[0][0] > 0.45, "the box moved")["work"][0]
    assert moved == pytest.approx([0.50, 0.35, 0.72, 0.67, 6], abs=TOLERANCE)
    drag((moved[2], moved[3]), (0.08, 0.08))  # its bottom-right corner: it grows
    resized = until_work(driver, lambda w: w[0][2] > 0.75, "the box resized")["work"][0]
    assert resized == pytest.approx([0.50, 0.35, 0.80, 0.75, 6], abs=TOLERANCE)
    assert editor_state(driver)["selected"] == 0

    press(driver, Keys.ARROW_RIGHT, Keys.ARROW_RIGHT)  # a selected box: arrows move it
    nudged = until_work(driver, lambda w: w[0][0] > resized[0] + 0.015, "two nudges")
    assert nudged["work"][0][:4] == pytest.approx(
        [resized[0] + 0.02, resized[1], resized[2] + 0.02, resized[3]], abs=1e-4
    )
    press(driver, Keys.ARROW_DOWN, shift=True)  # Shift: the bottom edge moves
    taller = until_work(driver, lambda w: w[0][3] > resized[3] + 0.005, "Shift+Down")["work"]
    assert taller[0][1] == pytest.approx(resized[1], abs=1e-4)
    shot(driver, site, "moved")

    press(driver, "u", "u", "u")  # each nudge is one undo step
    until_work(driver, lambda w: w[0] == pytest.approx(resized, abs=1e-4), "three undone")
    press(driver, "u")  # the resize
    until_work(driver, lambda w: w[0] == pytest.approx(moved, abs=1e-4), "the resize undone")
    press(driver, "u")  # the move
    until_work(driver, lambda w: w == teacher, "the teacher's box again")
    press(driver, Keys.ESCAPE)  # Esc lets the box go; arrows browse frames again
    wait(driver, lambda d: editor_state(d)["selected"] == -1, "no box selected")
    assert shown(driver) == sample_id
    press(driver, Keys.ARROW_RIGHT)
    wait(driver, lambda d: shown(d) == site.frames[3], "the next frame after an arrow")


def test_next_frame_and_accepting_either_answer(browser: Any, site: Site) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select

    driver = browser
    sign_in(driver, site)
    open_sample(driver, site, 3)  # the teacher saw nothing, the edge two things
    edge = rows(DETECTION_FRAMES[3][1])
    until_work(driver, lambda w: w == [], "the teacher's empty label")
    strong = driver.find_elements(By.CSS_SELECTOR, "#boxes rect.edge.strong")
    assert len(strong) == len(edge) and all(
        r.get_attribute("data-status") == "extra" for r in strong
    )
    press(driver, "E")
    until_work(driver, lambda w: w == edge, "E taking the edge's boxes")
    press(driver, "j")
    wait(driver, lambda d: shown(d) == site.frames[4], "J to the next frame")
    teacher, other = rows(DETECTION_FRAMES[4][0]), rows(DETECTION_FRAMES[4][1])
    until_work(driver, lambda w: w == teacher, "the next frame's teacher boxes")
    press(driver, "e")
    until_work(driver, lambda w: w == other, "the edge's boxes")
    press(driver, "t")
    until_work(driver, lambda w: w == teacher, "the teacher's boxes again")
    # The class list names every class and sets the selected box's class.
    press(driver, "\t")
    wait(driver, lambda d: editor_state(d)["selected"] == 0, "a box selected")
    choice = Select(driver.find_element(By.ID, "box-class"))
    assert [o.text for o in choice.options] == [str(i) for i in range(10)]
    choice.select_by_value("7")
    until_work(driver, lambda w: w[0][4] == 7, "the list changing the class")
    press(driver, "k")  # keys work again after the list: K goes back
    wait(driver, lambda d: shown(d) == site.frames[3], "K to the previous frame")
