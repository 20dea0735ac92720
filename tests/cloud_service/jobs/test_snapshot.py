"""The job's snapshot: identical frames count once and stay on one side of the split; the
holdout by sample id stays the same whatever else arrives."""

from __future__ import annotations

import numpy as np

from cloud_service.jobs.params import JobParams
from cloud_service.jobs.snapshot import VerifiedRow, distinct_frames, split_frames

FLEET = "line-1"


def test_identical_frames_count_once_and_stay_on_one_side_of_the_split() -> None:
    # 60 pictures, each sent 1-4 times (newest first); copy 2 of picture 7 has a human
    # label, and the newest copy does not.
    rng = np.random.default_rng(0)
    pictures = rng.integers(0, 255, (60, 8, 8, 3), dtype=np.uint8)
    order = [k for k in range(60) for _ in range(1 + k % 4)]
    rows, pixels = [], []
    for i, k in enumerate(order):
        human = k == 7 and order[:i].count(7) == 1
        rows.append(
            VerifiedRow(f"s{i}", f"k{i}", 9 if human else k % 10, k % 10, [0.1] * 10, human)
        )
        pixels.append(pictures[k])
    distinct = distinct_frames(rows, np.stack(pixels))
    assert len(distinct) == 60 and sum(len(f.sample_ids) for f in distinct) == len(rows)
    assert [f.row.sample_id for f in distinct[:2]] == ["s0", "s1"]  # newest copy stands
    seven = next(f for f in distinct if f.row.teacher_label == 7 and len(f.sample_ids) == 4)
    assert seven.row.label == 9 and seven.row.human
    train, val, holdout = split_frames(distinct, JobParams(fleet=FLEET, val_share=0.3))
    assert len(holdout) == 12 and holdout == distinct[:12]
    keys = [{f.key for f in part} for part in (train, val, holdout)]
    assert not (keys[0] & keys[1] or keys[0] & keys[2] or keys[1] & keys[2])
    assert len(keys[0]) + len(keys[1]) + len(keys[2]) == 60 and val


def _rows(n: int) -> tuple[list[VerifiedRow], np.ndarray]:
    rng = np.random.default_rng(0)
    rows = [VerifiedRow(f"id-{i:04d}", f"k{i}", i % 3, i % 3, [1 / 3] * 3, False) for i in range(n)]
    return rows, rng.integers(0, 255, (n, 4, 4, 3), dtype=np.uint8)


def test_the_holdout_by_sample_id_is_the_same_whatever_else_arrives() -> None:
    rows, pixels = _rows(300)
    p = JobParams(holdout_share=0.2)
    _, _, held = split_frames(distinct_frames(rows, pixels), p, by="sample-id")
    more_rows, more_pixels = _rows(400)  # 100 newer samples besides the same 300
    _, _, held_later = split_frames(distinct_frames(more_rows, more_pixels), p, by="sample-id")
    ids = {f.row.sample_id for f in held}
    assert 40 <= len(ids) <= 80
    assert ids <= {f.row.sample_id for f in held_later}
    train, val, _ = split_frames(distinct_frames(rows, pixels), p, by="sample-id")
    assert not ids & {f.row.sample_id for f in train + val}
