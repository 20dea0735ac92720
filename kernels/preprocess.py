"""uint8 NHWC camera frames -> resized, normalized NCHW tensors in one pass.

Kernel, launcher, NumPy reference and benchmark side by side (triton tutorials):

* ``_preprocess_kernel``: each program writes ``BLOCK`` output pixels of one image,
  all three channels: it reads the four source pixels of each (half-pixel bilinear,
  the same sampling as ``cv2.resize``/``F.interpolate(align_corners=False)``), scales
  to [0, 1], subtracts the mean, divides by the std and stores fp32 or fp16 NCHW;
  the uint8 frame is read once and the float tensor written once.
* ``preprocess``: allocates the output and builds the grid.
* ``preprocess_reference``: the same arithmetic in NumPy, what the tests compare with.
* ``bench``: GB/s of the kernel against the bytes it must move.

On CPU the kernel runs in Triton's interpreter (``TRITON_INTERPRET=1``); it is used
for real only where CUDA is present (``available()``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from kernels import available

try:  # triton is the `gpu` extra (and `dev`, for the interpreter tests)
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised where triton is not installed
    HAVE_TRITON = False

__all__ = ["available", "bench", "preprocess", "preprocess_reference"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


if HAVE_TRITON:

    @triton.jit
    def _preprocess_kernel(  # type: ignore[no-untyped-def]  # triton kernel
        src_ptr,  # *uint8 [N, H, W, 3] NHWC frames, contiguous
        out_ptr,  # *fp32 or *fp16 [N, 3, OH, OW] NCHW output, contiguous
        H,  # source height (pixels)
        W,  # source width (pixels)
        OH,  # output height (pixels)
        OW,  # output width (pixels)
        scale_h,  # H / OH as fp32: source rows per output row
        scale_w,  # W / OW as fp32: source columns per output column
        mean0,  # channel 0 mean, in [0, 1] units
        mean1,  # channel 1 mean
        mean2,  # channel 2 mean
        inv_std0,  # 1 / channel 0 std (multiply, don't divide)
        inv_std1,  # 1 / channel 1 std
        inv_std2,  # 1 / channel 2 std
        BLOCK: tl.constexpr,  # output pixels per program (a power of two)
    ):
        image = tl.program_id(0)  # which frame of the batch
        block = tl.program_id(1)  # which run of BLOCK output pixels
        offs = block * BLOCK + tl.arange(0, BLOCK)
        mask = offs < OH * OW
        oy = offs // OW
        ox = offs % OW
        # Half-pixel centres, clamped at the top/left edge like OpenCV.
        sy = tl.maximum((oy.to(tl.float32) + 0.5) * scale_h - 0.5, 0.0)
        sx = tl.maximum((ox.to(tl.float32) + 0.5) * scale_w - 0.5, 0.0)
        y0 = tl.minimum(sy.to(tl.int32), H - 1)  # floor: sy >= 0
        x0 = tl.minimum(sx.to(tl.int32), W - 1)
        y1 = tl.minimum(y0 + 1, H - 1)
        x1 = tl.minimum(x0 + 1, W - 1)
        wy = sy - y0.to(tl.float32)
        wx = sx - x0.to(tl.float32)
        # int64 offsets: a batch of 4K frames passes 2**31 bytes.
        base = image.to(tl.int64) * H * W * 3
        p00 = base + (y0 * W + x0) * 3
        p01 = base + (y0 * W + x1) * 3
        p10 = base + (y1 * W + x0) * 3
        p11 = base + (y1 * W + x1) * 3
        out_base = image.to(tl.int64) * 3 * OH * OW + offs
        for c in tl.static_range(3):
            v00 = tl.load(src_ptr + p00 + c, mask=mask, other=0).to(tl.float32)
            v01 = tl.load(src_ptr + p01 + c, mask=mask, other=0).to(tl.float32)
            v10 = tl.load(src_ptr + p10 + c, mask=mask, other=0).to(tl.float32)
            v11 = tl.load(src_ptr + p11 + c, mask=mask, other=0).to(tl.float32)
            top = v00 + (v01 - v00) * wx
            bottom = v10 + (v11 - v10) * wx
            value = (top + (bottom - top) * wy) * (1.0 / 255.0)
            if c == 0:
                value = (value - mean0) * inv_std0
            elif c == 1:
                value = (value - mean1) * inv_std1
            else:
                value = (value - mean2) * inv_std2
            tl.store(
                out_ptr + out_base + c * OH * OW,
                value.to(out_ptr.dtype.element_ty),
                mask=mask,
            )


def preprocess(
    frames: Any,
    size: tuple[int, int],
    *,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    fp16: bool = False,
    block: int = 256,
) -> Any:
    """Launch the kernel: torch uint8 [N, H, W, 3] -> torch [N, 3, OH, OW] fp32 (or fp16)."""
    if not HAVE_TRITON:
        raise RuntimeError("triton is not installed: install the `gpu` extra")
    import torch

    if frames.dtype != torch.uint8 or frames.ndim != 4 or frames.shape[3] != 3:
        raise ValueError(f"frames must be uint8 [N, H, W, 3], got {frames.dtype} {frames.shape}")
    frames = frames.contiguous()
    n, h, w, _ = frames.shape
    oh, ow = size
    out = torch.empty(
        (n, 3, oh, ow), dtype=torch.float16 if fp16 else torch.float32, device=frames.device
    )
    grid = (n, triton.cdiv(oh * ow, block))
    _preprocess_kernel[grid](
        frames,
        out,
        h,
        w,
        oh,
        ow,
        h / oh,
        w / ow,
        float(mean[0]),
        float(mean[1]),
        float(mean[2]),
        1.0 / float(std[0]),
        1.0 / float(std[1]),
        1.0 / float(std[2]),
        BLOCK=block,
    )
    return out


def preprocess_reference(
    frames: np.ndarray,
    size: tuple[int, int],
    *,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    fp16: bool = False,
) -> np.ndarray:
    """NumPy: uint8 [N, H, W, 3] -> [N, 3, OH, OW], half-pixel bilinear, normalized."""
    _, h, w, _ = frames.shape
    oh, ow = size
    sy = np.maximum((np.arange(oh, dtype=np.float32) + 0.5) * np.float32(h / oh) - 0.5, 0.0)
    sx = np.maximum((np.arange(ow, dtype=np.float32) + 0.5) * np.float32(w / ow) - 0.5, 0.0)
    y0 = np.minimum(sy.astype(np.int64), h - 1)
    x0 = np.minimum(sx.astype(np.int64), w - 1)
    y1 = np.minimum(y0 + 1, h - 1)
    x1 = np.minimum(x0 + 1, w - 1)
    wy = (sy - y0)[None, :, None, None].astype(np.float32)
    wx = (sx - x0)[None, None, :, None].astype(np.float32)
    f = frames.astype(np.float32)
    v00 = f[:, y0][:, :, x0]
    v01 = f[:, y0][:, :, x1]
    v10 = f[:, y1][:, :, x0]
    v11 = f[:, y1][:, :, x1]
    top = v00 + (v01 - v00) * wx
    bottom = v10 + (v11 - v10) * wx
    value = (top + (bottom - top) * wy) / np.float32(255.0)
    value = (value - np.asarray(mean, np.float32)) * (1.0 / np.asarray(std, np.float32))
    out = np.ascontiguousarray(value.transpose(0, 3, 1, 2))
    return out.astype(np.float16 if fp16 else np.float32)


def bench(
    batch: int = 32, src: tuple[int, int] = (480, 640), size: tuple[int, int] = (224, 224)
) -> dict[str, float]:
    """GB/s of the kernel on CUDA (bytes read + written over the median time)."""
    import torch

    frames = torch.randint(0, 256, (batch, *src, 3), dtype=torch.uint8, device="cuda")
    for _ in range(3):
        preprocess(frames, size)
    torch.cuda.synchronize()
    samples = []
    for _ in range(20):
        start = time.perf_counter()
        preprocess(frames, size)
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    seconds = float(np.median(samples))
    # Every output pixel reads its 4 neighbours; on a downscale each source byte is
    # read at most once from DRAM (the rest hit cache), so count the smaller of the two.
    read = min(frames.numel(), batch * size[0] * size[1] * 3 * 4)
    written = batch * 3 * size[0] * size[1] * 4
    return {"seconds": seconds, "gb_per_s": (read + written) / seconds / 1e9}
