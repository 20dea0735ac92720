"""The agent's spool: CPU and bytes written per forwarded sample, by SQLite page size.

    python -m bench.run --only spool        # or: python -m bench.spool [--quick]

Forwarded samples reach the disk as the agent's forward path writes them: each
inference batch of eight frames forwards each frame with the agent bench's forward
share (16%), and the batch's forwarded samples are one spool transaction (so most
transactions hold one or two samples; a live camera's small batches hold one); the
cloud's receipts arrive every few transactions, for the samples published before
the last receipt, each applied in its own transaction; every sample's verdict is
stored in the verdict store's own file (4 KiB pages). Envelopes of 23 KB (a 320x240
frame at the agent's upload quality, as the agent bench forwards) and 46 KB (a
larger frame). Measured for each spool page size on fresh files, with the agent's own
``Spool`` and ``VerdictStore``; CPU is this process's, bytes are what it wrote
(``wchar``: the envelopes appended to the payload log, the rows' WAL and checkpoints
included). The envelopes are in the payload log's segment files, not in SQLite's
pages, so the page size moves only the rows' share. The spool uses ``PAGE_SIZE``.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.common import markdown_table

PAGE_SIZES = (4096, 8192, 16384, 32768)
ENVELOPE_SIZES = (23_000, 46_000)
BATCH = 8  # frames per inference batch (the agent's max_batch)
FORWARD_SHARE = 0.16  # of the agent bench's frames, reference student
RECEIPT_EVERY = 5  # writer transactions per receipt (about 8 samples, as at 150 forwarded/s)


def _written() -> int:
    with open(f"/proc/{os.getpid()}/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("wchar"))


def _transactions(samples: int, seed: int = 0) -> list[int]:
    """Samples per spool transaction: the forwarded frames of each batch that has any."""
    rng = random.Random(seed)
    sizes: list[int] = []
    left = samples
    while left > 0:
        forwarded = min(left, sum(rng.random() < FORWARD_SHARE for _ in range(BATCH)))
        if forwarded:
            sizes.append(forwarded)
            left -= forwarded
    return sizes


def _one_run(page_size: int, envelope_bytes: int, samples: int) -> dict[str, float]:
    from edge_agent.agent import VerdictStore
    from edge_agent.spool import NewSample, Spool
    from shared.ids import new_sample_id

    payload = os.urandom(envelope_bytes)
    verdict = {"label": 3, "scores": [0.1] * 10, "teacher_model": "teacher", "agrees": True}
    with tempfile.TemporaryDirectory() as tmp:
        spool = Spool(Path(tmp) / "spool.db", page_size=page_size)
        verdicts = VerdictStore(Path(tmp) / "spool-verdicts.db", keep=100_000)
        cpu, wrote = time.process_time(), _written()
        published: list[str] = []  # since the last receipt
        in_flight: list[str] = []  # published before it: the next receipt's ids
        for index, size in enumerate(_transactions(samples)):
            batch = [
                NewSample(new_sample_id(), payload, priority=3, audit=False) for _ in range(size)
            ]
            spool.write(batch, now=1.0, published=True)
            published += [s.sample_id for s in batch]
            if (index + 1) % RECEIPT_EVERY == 0:
                spool.ack(in_flight)
                for sample_id in in_flight:
                    verdicts.put(sample_id, verdict, {"label": 3}, 1.0)
                in_flight, published = published, []
        for sample_id in in_flight + published:
            spool.ack([sample_id])
            verdicts.put(sample_id, verdict, {"label": 3}, 1.0)
        cpu, wrote = time.process_time() - cpu, _written() - wrote
        spool.close()
        verdicts.close()
    return {"cpu_us": cpu / samples * 1e6, "written_kib": wrote / samples / 1024}


def run(quick: bool = False) -> dict[str, Any]:
    from edge_agent.spool import PAGE_SIZE

    samples = 200 if quick else 800
    repeats = 3 if quick else 5
    cases = [(page, envelope) for envelope in ENVELOPE_SIZES for page in PAGE_SIZES]
    runs: dict[tuple[int, int], list[dict[str, float]]] = {case: [] for case in cases}
    for _ in range(repeats):  # the cases take turns, so a noisy host hits them alike
        for page, envelope in cases:
            runs[(page, envelope)].append(_one_run(page, envelope, samples))
    summary: dict[str, Any] = {}
    rows = []
    for page in PAGE_SIZES:
        row: list[Any] = [page]
        for envelope in ENVELOPE_SIZES:
            cpu = statistics.median(r["cpu_us"] for r in runs[(page, envelope)])
            written = statistics.median(r["written_kib"] for r in runs[(page, envelope)])
            summary[f"page_{page}_{envelope // 1000}kb"] = {
                "cpu_us_per_sample": cpu,
                "written_kib_per_sample": written,
            }
            row += [cpu, written]
        rows.append([*row, "yes" if page == PAGE_SIZE else ""])
    transactions = _transactions(samples)
    summary["samples_per_transaction"] = samples / len(transactions)
    headers = ["page size B"]
    for envelope in ENVELOPE_SIZES:
        headers += [
            f"CPU us/sample, {envelope // 1000} KB",
            f"KiB written/sample, {envelope // 1000} KB",
        ]
    tables = [
        markdown_table([*headers, "the spool's"], rows),
        f"Per sample: stored in a spool transaction with the other forwarded frames of its"
        f" inference batch ({summary['samples_per_transaction']:.2f} samples per transaction:"
        f" {FORWARD_SHARE:.0%} of batches of {BATCH} forwarded), deleted by a receipt every"
        f" {RECEIPT_EVERY} transactions, its verdict stored; {samples} samples per run,"
        f" medians of {repeats} runs.",
    ]
    return {"figures": summary, "tables": tables}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    print("\n\n".join(run(args.quick)["tables"]))
