"""The model files of a round: which frames calibrate the INT8 quantization."""

from __future__ import annotations

import numpy as np

from distill.release import calibration_frames


def test_int8_calibration_mixes_recent_and_replay_frames() -> None:
    rng = np.random.default_rng(0)
    recent = np.zeros((300, 4, 4, 3), np.uint8)
    val = np.ones((40, 4, 4, 3), np.uint8)
    replay = np.full((500, 4, 4, 3), 2, np.uint8)
    picked = calibration_frames(recent, val, replay, 256, rng)
    kinds = picked[:, 0, 0, 0]
    assert len(picked) == 256
    assert (kinds == 2).sum() == 128 and ((kinds == 0) | (kinds == 1)).sum() == 128
    # Few recent frames: all of them, the rest replay; no replay: recent only.
    few = calibration_frames(recent[:20], val[:0], replay, 256, rng)
    assert len(few) == 256 and (few[:, 0, 0, 0] == 0).sum() == 20
    alone = calibration_frames(recent, val, replay[:0], 256, rng)
    assert len(alone) == 256 and (alone[:, 0, 0, 0] != 2).all()
