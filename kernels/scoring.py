"""Confidence scoring in one pass over a batch of logits: softmax, top-1, top-2 margin, entropy.

Kernel, launcher, NumPy reference and benchmark side by side (triton tutorials):

* ``_scoring_kernel``: one program per row; the row is loaded once into registers,
  and the probabilities, the top-1 index and probability, the margin to the second
  best and the entropy (nats) all come out of that one load.
* ``score``: allocates the outputs and builds the grid.
* ``score_reference``: the same in NumPy.
* ``bench``: GB/s against the bytes moved.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import numpy as np

from kernels import available

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    HAVE_TRITON = False

__all__ = ["Scores", "available", "bench", "score", "score_reference"]


class Scores(NamedTuple):
    probs: Any  # [B, C] float32 softmax
    top1: Any  # [B] int32 index of the best class
    confidence: Any  # [B] float32 its probability
    margin: Any  # [B] float32 top-1 minus top-2 probability
    entropy: Any  # [B] float32 entropy in nats


if HAVE_TRITON:

    @triton.jit
    def _scoring_kernel(  # type: ignore[no-untyped-def]  # triton kernel
        logits_ptr,  # *fp32/fp16 [B, C] logits, row-major
        probs_ptr,  # *fp32 [B, C] out: softmax probabilities
        top1_ptr,  # *int32 [B] out: index of the largest probability
        conf_ptr,  # *fp32 [B] out: the largest probability
        margin_ptr,  # *fp32 [B] out: largest minus second-largest probability
        entropy_ptr,  # *fp32 [B] out: -sum p log p, in nats
        C,  # classes per row
        row_stride,  # elements between rows of logits (and of probs)
        BLOCK_C: tl.constexpr,  # next power of two >= C; the whole row in one block
    ):
        row = tl.program_id(0)  # one program per row of the batch
        cols = tl.arange(0, BLOCK_C)
        mask = cols < C
        base = row.to(tl.int64) * row_stride
        x = tl.load(logits_ptr + base + cols, mask=mask, other=-float("inf")).to(tl.float32)
        x_max = tl.max(x, axis=0)
        shifted = tl.where(mask, x - x_max, 0.0)  # 0 off the row: no 0 * -inf below
        e = tl.where(mask, tl.exp(shifted), 0.0)
        total = tl.sum(e, axis=0)
        p = e / total
        tl.store(probs_ptr + base + cols, p, mask=mask)
        # Entropy from the log-sum-exp form: no log(0) on underflowed classes.
        entropy = tl.log(total) - tl.sum(tl.where(mask, p * shifted, 0.0), axis=0)
        best = tl.argmax(p, axis=0)
        p1 = tl.max(p, axis=0)
        p2 = tl.max(tl.where(mask & (cols != best), p, -1.0), axis=0)
        p2 = tl.maximum(p2, 0.0)  # one class only: margin is p1
        tl.store(top1_ptr + row, best.to(tl.int32))
        tl.store(conf_ptr + row, p1)
        tl.store(margin_ptr + row, p1 - p2)
        tl.store(entropy_ptr + row, entropy)


def score(logits: Any) -> Scores:
    """Launch the kernel on torch logits [B, C] (fp32 or fp16)."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed: install the `gpu` extra")
    import torch

    if logits.ndim != 2:
        raise ValueError(f"logits must be [B, C], got {tuple(logits.shape)}")
    logits = logits.contiguous()
    b, c = logits.shape
    device = logits.device
    probs = torch.empty((b, c), dtype=torch.float32, device=device)
    top1 = torch.empty(b, dtype=torch.int32, device=device)
    conf = torch.empty(b, dtype=torch.float32, device=device)
    margin = torch.empty(b, dtype=torch.float32, device=device)
    entropy = torch.empty(b, dtype=torch.float32, device=device)
    if b:
        _scoring_kernel[(b,)](
            logits, probs, top1, conf, margin, entropy, c, c, BLOCK_C=triton.next_power_of_2(c)
        )
    return Scores(probs, top1, conf, margin, entropy)


def score_reference(logits: np.ndarray) -> Scores:
    """NumPy: the same five outputs."""
    x = logits.astype(np.float32)
    shifted = x - x.max(axis=1, keepdims=True)
    e = np.exp(shifted)
    total = e.sum(axis=1, keepdims=True)
    p = e / total
    top1 = p.argmax(axis=1).astype(np.int32)
    ordered = np.sort(p, axis=1)
    p1 = ordered[:, -1]
    p2 = ordered[:, -2] if p.shape[1] > 1 else np.zeros_like(p1)
    entropy = np.log(total[:, 0]) - (p * shifted).sum(axis=1)
    return Scores(p, top1, p1, (p1 - p2).astype(np.float32), entropy.astype(np.float32))


def bench(batch: int = 65536, classes: int = 1000) -> dict[str, float]:
    """GB/s of the kernel on CUDA (logits read + probabilities and stats written)."""
    import torch

    logits = torch.randn(batch, classes, device="cuda")
    for _ in range(3):
        score(logits)
    torch.cuda.synchronize()
    samples = []
    for _ in range(20):
        start = time.perf_counter()
        score(logits)
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    seconds = float(np.median(samples))
    moved = batch * classes * 4 * 2 + batch * 4 * 4
    return {"seconds": seconds, "gb_per_s": moved / seconds / 1e9}
