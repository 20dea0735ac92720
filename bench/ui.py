"""Review UI: queue pages over 100,000 samples in PostgreSQL, and the review round trip.

Seeds a fresh PostgreSQL database (bulk inserts; 20,000 samples with --quick) with
samples and verdicts, serves the app with uvicorn on loopback, and times over HTTP:

* the queue page (HTML, 50 rows, with its total count): first page, a deep page
  (offset 50,000 with keyset ordering by capture time), and a filtered page;
* the review round trip as the page's script makes it: POST the review, whose
  answer carries the next sample of the filter (one request), then GET its image.

Goals: queue page <= 300 ms server time, review round trip <= 150 ms. The browser
figure (key press to next image shown, performance.now()) comes from the UI's
browser test, which writes review-timings.json to its artifacts.
"""

from __future__ import annotations

import re
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from sqlalchemy import text

from bench.common import markdown_table
from cloud_service.api import create_app
from cloud_service.db import crud
from cloud_service.settings import CloudSettings
from cloud_service.ui.seed import seed
from shared.broker import free_port
from simulations.databases import fresh_database

PASSWORD = "bench-password-1"


def _timed(fn: Any, repeats: int) -> tuple[float, float]:
    """Median and p90 in ms of ``fn()`` after one warm-up call."""
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    samples.sort()
    return statistics.median(samples), samples[int(0.9 * (len(samples) - 1))]


def run(quick: bool = False) -> dict[str, Any]:
    n = 20_000 if quick else 100_000
    repeats = 7 if quick else 15
    work = Path(tempfile.mkdtemp(prefix="edgeloop-bench-ui-"))
    with fresh_database(prefix="edgeloop_bench_ui") as url:
        settings = CloudSettings(
            data_dir=work, database_url=url, blob_fsync=False, rollout_tick_s=0
        )
        app = create_app(settings)
        state = app.state.edgeloop
        start = time.perf_counter()
        with state.sessions.begin() as session:
            crud.create_user(session=session, username="bench", password=PASSWORD, role="reviewer")
            seeded = seed(session=session, blobs=state.blobs, samples=n, agents=8, hours=24 * 14)
        seed_s = time.perf_counter() - start
        with state.engine.connect() as conn:
            conn.execute(text("ANALYZE"))
            conn.commit()
        import uvicorn

        port = free_port()
        server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning")
        )
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        while not server.started:
            time.sleep(0.05)
        try:
            figures = _measure(f"http://127.0.0.1:{port}", seeded, repeats)
        finally:
            server.should_exit = True
            thread.join(10)
        figures["samples"] = n
        figures["flagged"] = len(seeded["flagged"])
        figures["seed_s"] = round(seed_s, 1)
    rows = [
        [name, round(figures[f"{key}_ms"], 1), round(figures[f"{key}_p90_ms"], 1), goal]
        for name, key, goal in [
            ("queue, first page", "queue_first", "<= 300 ms"),
            ("queue, deep page (offset 50,000)", "queue_deep", "<= 300 ms"),
            ("queue, filtered (agent, reason, conf.)", "queue_filtered", "<= 300 ms"),
            ("review: POST + next sample (1 request)", "review", "<= 150 ms"),
            ("review: POST + next + its image", "review_image", "<= 150 ms"),
            ("J/K: neighbour sample", "neighbour", "-"),
        ]
    ]
    table = markdown_table(
        ["request (PostgreSQL, loopback HTTP)", "median ms", "p90 ms", "goal"], rows
    )
    note = (
        f"{n:,} samples with verdicts ({figures['flagged']:,} flagged), seeded in "
        f"{figures['seed_s']} s; 50 rows a page, each with its total count."
    )
    return {"figures": figures, "tables": [note + "\n\n" + table]}


def _measure(base: str, seeded: dict[str, Any], repeats: int) -> dict[str, Any]:
    figures: dict[str, Any] = {}
    with httpx.Client(base_url=base, follow_redirects=False, timeout=30) as client:
        page = client.get("/ui/login")
        token = re.search(r'name="csrf_token" value="([^"]+)"', page.text)
        assert token is not None
        client.post(
            "/ui/login",
            data={"username": "bench", "password": PASSWORD, "csrf_token": token.group(1)},
        )
        queue = client.get("/ui/queue")
        assert queue.status_code == 200, queue.status_code
        csrf = re.search(r'<meta name="csrf-token" content="([^"]+)"', queue.text)
        assert csrf is not None
        headers = {"X-CSRF-Token": csrf.group(1)}

        def get(path: str) -> Any:
            def fn() -> None:
                answer = client.get(path)
                assert answer.status_code == 200, (path, answer.status_code)

            return fn

        for key, path in [
            ("queue_first", "/ui/queue"),
            ("queue_deep", "/ui/queue?page=1001"),
            (
                "queue_filtered",
                "/ui/queue?status=any&agent=cam-3&reason=audit&conf_min=0.3&conf_max=0.6",
            ),
        ]:
            figures[f"{key}_ms"], figures[f"{key}_p90_ms"] = _timed(get(path), repeats)

        ids = iter(seeded["flagged"][: 3 * repeats + 10])

        def review(with_image: bool) -> Any:
            def fn() -> None:
                sample_id = next(ids)
                view = client.get(f"/ui/api/samples/{sample_id}").json()  # untimed below
                start = time.perf_counter()
                answer = client.post(
                    f"/ui/api/samples/{sample_id}/review",
                    json={"action": "label", "label": 1, "token": view["token"],
                          "query": "status=flagged"},
                    headers=headers,
                )  # fmt: skip
                assert answer.status_code == 200, answer.text
                if with_image:
                    client.get(answer.json()["next"]["image_url"])
                fn.elapsed.append((time.perf_counter() - start) * 1000)  # type: ignore[attr-defined]

            fn.elapsed = []  # type: ignore[attr-defined]
            return fn

        for key, with_image in (("review", False), ("review_image", True)):
            fn = review(with_image)
            for _ in range(repeats + 1):
                fn()
            elapsed = sorted(fn.elapsed[1:])
            figures[f"{key}_ms"] = statistics.median(elapsed)
            figures[f"{key}_p90_ms"] = elapsed[int(0.9 * (len(elapsed) - 1))]
        last = seeded["flagged"][-1]
        figures["neighbour_ms"], figures["neighbour_p90_ms"] = _timed(
            get(f"/ui/api/samples/{last}/neighbour?direction=prev"), repeats
        )
    return {k: round(v, 2) if isinstance(v, float) else v for k, v in figures.items()}
