"""Each kernel against its NumPy reference (interpreter on CPU, compiled on CUDA)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from kernels import preprocess as pre
from kernels import scoring

torch = pytest.importorskip("torch")
if not pre.HAVE_TRITON:
    pytest.skip("triton is not installed (pip install the dev extra)", allow_module_level=True)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET=0 and no CUDA device", allow_module_level=True)


@pytest.mark.parametrize(
    ("src", "size", "fp16"),
    [((17, 23), (8, 8), False), ((8, 8), (13, 11), False), ((30, 40), (12, 16), True)],
)
def test_preprocess_matches_reference(
    src: tuple[int, int], size: tuple[int, int], fp16: bool
) -> None:
    rng = np.random.default_rng(0)
    frames = rng.integers(0, 256, (2, *src, 3), dtype=np.uint8)
    got = pre.preprocess(torch.from_numpy(frames).to(DEVICE), size, fp16=fp16, block=64)
    want = pre.preprocess_reference(frames, size, fp16=fp16)
    assert tuple(got.shape) == (2, 3, *size)
    assert got.dtype == (torch.float16 if fp16 else torch.float32)
    np.testing.assert_allclose(
        got.float().cpu().numpy(), want.astype(np.float32), atol=2e-2 if fp16 else 1e-4
    )


def test_preprocess_reference_matches_opencv_resize() -> None:
    cv2 = pytest.importorskip("cv2")
    rng = np.random.default_rng(1)
    frame = rng.integers(0, 256, (24, 32, 3), dtype=np.uint8)
    ref = pre.preprocess_reference(frame[None], (12, 16), mean=(0, 0, 0), std=(1, 1, 1))
    resized = cv2.resize(frame.astype(np.float32), (16, 12), interpolation=cv2.INTER_LINEAR)
    np.testing.assert_allclose(ref[0].transpose(1, 2, 0) * 255, resized, atol=1e-3)


def test_preprocess_refuses_bad_input() -> None:
    with pytest.raises(ValueError, match="uint8"):
        pre.preprocess(torch.zeros((1, 4, 4, 3), dtype=torch.float32), (2, 2))


@pytest.mark.parametrize(("batch", "classes"), [(5, 10), (3, 1), (4, 37)])
def test_scoring_matches_reference(batch: int, classes: int) -> None:
    rng = np.random.default_rng(2)
    logits = (rng.normal(size=(batch, classes)) * 4).astype(np.float32)
    got = scoring.score(torch.from_numpy(logits).to(DEVICE))
    want = scoring.score_reference(logits)
    np.testing.assert_allclose(got.probs.cpu().numpy(), want.probs, atol=1e-6)
    np.testing.assert_array_equal(got.top1.cpu().numpy(), want.top1)
    np.testing.assert_allclose(got.confidence.cpu().numpy(), want.confidence, atol=1e-6)
    np.testing.assert_allclose(got.margin.cpu().numpy(), want.margin, atol=1e-6)
    np.testing.assert_allclose(got.entropy.cpu().numpy(), want.entropy, atol=1e-5)


def test_scoring_reference_is_softmax() -> None:
    logits = np.array([[0.0, 0.0], [10.0, -10.0]], np.float32)
    ref = scoring.score_reference(logits)
    np.testing.assert_allclose(ref.probs.sum(axis=1), 1.0, rtol=1e-6)
    assert ref.margin[0] == pytest.approx(0.0)
    assert ref.entropy[0] == pytest.approx(np.log(2.0))
    assert ref.top1[1] == 0


def test_available_under_interpreter() -> None:
    assert pre.available() is (INTERPRET or torch.cuda.is_available())
    assert scoring.available() is pre.available()
