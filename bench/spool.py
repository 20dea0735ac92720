"""The agent's spool: CPU and bytes written per forwarded sample, by SQLite page size.

    python -m bench.run --only spool        # or: python -m bench.spool [--quick]

One forwarded sample's life on the agent's disk: stored in the spool in a writer
batch of eight (as sent), its verdict stored in the verdict store's own file (4 KiB
pages), deleted from the spool by a receipt for 50 samples. Measured for each spool
page size on fresh files, with the agent's own ``Spool`` and ``VerdictStore``; CPU
is this process's, bytes are what it wrote (``wchar``: WAL and checkpoints
included). The spool uses ``PAGE_SIZE``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import markdown_table

PAGE_SIZES = (4096, 16384, 32768)
ENVELOPE_BYTES = 46_000  # a forwarded 320x240 camera JPEG in its envelope
WRITE_BATCH = 8
RECEIPT_BATCH = 50


def _written() -> int:
    with open(f"/proc/{os.getpid()}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar"))


def _one_run(page_size: int, samples: int) -> dict[str, float]:
    from edge_agent.agent import VerdictStore
    from edge_agent.spool import NewSample, Spool
    from shared.ids import new_sample_id

    payload = os.urandom(ENVELOPE_BYTES)
    verdict = {"label": 3, "scores": [0.1] * 10, "teacher_model": "teacher", "agrees": True}
    with tempfile.TemporaryDirectory() as tmp:
        spool = Spool(Path(tmp) / "spool.db", page_size=page_size)
        verdicts = VerdictStore(Path(tmp) / "spool-verdicts.db", keep=100_000)
        cpu, wrote = time.process_time(), _written()
        ids: list[str] = []
        for _ in range(samples // WRITE_BATCH):
            batch = [
                NewSample(new_sample_id(), payload, priority=3, audit=False)
                for _ in range(WRITE_BATCH)
            ]
            spool.write(batch, now=1.0, published=True)
            ids += [s.sample_id for s in batch]
        for sample_id in ids:
            verdicts.put(sample_id, verdict, {"label": 3}, 1.0)
        for at in range(0, len(ids), RECEIPT_BATCH):
            spool.ack(ids[at : at + RECEIPT_BATCH])
        cpu, wrote = time.process_time() - cpu, _written() - wrote
        spool.close()
        verdicts.close()
    return {"cpu_us": cpu / len(ids) * 1e6, "written_kib": wrote / len(ids) / 1024}


def run(quick: bool = False) -> dict[str, Any]:
    from edge_agent.spool import PAGE_SIZE

    samples = 200 if quick else 800
    repeats = 3 if quick else 5
    runs_by_size: dict[int, list[dict[str, float]]] = {size: [] for size in PAGE_SIZES}
    rows = []
    for _ in range(repeats):  # page sizes take turns, so a noisy host hits them alike
        for page_size in PAGE_SIZES:
            runs_by_size[page_size].append(_one_run(page_size, samples))
    summary: dict[str, Any] = {}
    for page_size in PAGE_SIZES:
        runs = runs_by_size[page_size]
        cpu = statistics.median(r["cpu_us"] for r in runs)
        written = statistics.median(r["written_kib"] for r in runs)
        summary[f"page_{page_size}"] = {"cpu_us_per_sample": cpu, "written_kib_per_sample": written}
        rows.append([page_size, cpu, written, "yes" if page_size == PAGE_SIZE else ""])
    base = summary["page_4096"]["cpu_us_per_sample"]
    summary["cpu_vs_default_pages"] = summary[f"page_{PAGE_SIZE}"]["cpu_us_per_sample"] / base
    tables = [
        markdown_table(
            ["page size B", "CPU us per sample", "KiB written per sample", "the spool's"], rows
        ),
        f"{ENVELOPE_BYTES // 1000} KB envelopes; per sample: stored in a batch of {WRITE_BATCH},"
        f" its verdict stored, deleted by a receipt for {RECEIPT_BATCH}; {samples} samples per"
        f" run, medians of {repeats} runs.",
    ]
    return {"figures": summary, "tables": tables}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print("\n\n".join(run(args.quick)["tables"]))
