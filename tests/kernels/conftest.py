"""Kernel tests run in Triton's interpreter on CPU: set it before anything imports triton."""

import os

# GPU runs (make gpu-check) pass TRITON_INTERPRET=0 to compile the kernels for real.
os.environ.setdefault("TRITON_INTERPRET", "1")
