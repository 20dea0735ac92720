"""EdgeLoop kernels: Triton pre- and post-processing, each beside a NumPy reference."""

from __future__ import annotations

import importlib.util
import os

# triton is the `gpu` extra (and `dev`, for the interpreter tests).
HAVE_TRITON = importlib.util.find_spec("triton") is not None

__all__ = ["HAVE_TRITON", "available"]


def available() -> bool:
    """True when the kernels can run: triton importable and CUDA present (or the interpreter)."""
    if not HAVE_TRITON:
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False
