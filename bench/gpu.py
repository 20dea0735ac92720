"""GPU benchmarks (run by ``make gpu-check``): kernels against the memory bandwidth peak,
teacher TensorRT INT8 against CUDA FP32 at batch 32, CUDA verifier batched against raw.

Skips (with the reason in its figures) where there is no CUDA device.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import markdown_table, median_seconds

# HBM peak by device name, GB/s (vendor datasheets); unknown devices report GB/s only.
PEAK_GBPS = {"H200": 4800.0, "H100": 3350.0, "A100": 2039.0, "L4": 300.0, "A10": 600.0}


def _peak(name: str) -> float | None:
    return next((v for k, v in PEAK_GBPS.items() if k in name), None)


def run(quick: bool = False) -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"figures": {"skipped": "torch not installed"}, "tables": []}
    if not torch.cuda.is_available():
        return {
            "figures": {"skipped": "no CUDA device"},
            "tables": ["GPU section skipped: no CUDA device."],
        }
    figures: dict[str, Any] = {"device": torch.cuda.get_device_name(0)}
    rows: list[list[Any]] = []
    peak = _peak(figures["device"])
    from kernels import preprocess, scoring

    for label, result in (
        ("preprocess 32x480x640 -> 224", preprocess.bench()),
        ("scoring 65536x1000", scoring.bench()),
    ):
        share = result["gb_per_s"] / peak if peak else None
        figures[label] = {**result, "share_of_peak": share}
        rows.append(
            [label, result["gb_per_s"], peak or "?", share if share is not None else "?", ">= 0.6"]
        )
    tables = [markdown_table(["kernel", "GB/s", "peak GB/s", "share", "goal"], rows)]

    import onnxruntime as ort

    from cloud_service.batcher import BatcherConfig, DynamicBatcher
    from cloud_service.demo_teacher import build_demo_teacher
    from cloud_service.verifier import TeacherModel

    work = Path(tempfile.mkdtemp(prefix="edgeloop-gpu-"))
    model = build_demo_teacher(work / "teacher.onnx", size=64, hidden=2048, seed=0)
    frames = np.random.default_rng(0).integers(0, 255, (32, 64, 64, 3), dtype=np.uint8)
    available = ort.get_available_providers()
    rates: dict[str, float] = {}
    if "CUDAExecutionProvider" in available:
        cuda = TeacherModel(model, providers=["CUDAExecutionProvider"])
        rates["cuda_fp32"] = 32 / median_seconds(lambda: cuda.predict(frames), repeats=20, warmup=3)
        items = list(frames) * 16
        with DynamicBatcher(
            cuda.predict_many, BatcherConfig(max_batch_size=32, max_queue_delay_s=0.002)
        ) as b:

            def burst() -> None:
                for f in [b.submit(x, shape=x.shape) for x in items]:
                    f.result(60)

            rates["cuda_batcher"] = len(items) / median_seconds(burst, repeats=5)
        figures["cuda_verifier_batched_vs_raw"] = rates["cuda_batcher"] / rates["cuda_fp32"]
    if "TensorrtExecutionProvider" in available:
        from distill.quantize import quantize_onnx

        def int8_model() -> Path:
            out = work / "teacher-int8.onnx"
            quantize_onnx(model, out, np.concatenate([frames] * 4))
            return out

        for name, path, int8 in (("trt_fp16", model, False), ("trt_int8", None, True)):
            try:
                src = path or int8_model()
                t = TeacherModel(
                    src,
                    providers=["TensorrtExecutionProvider", "CUDAExecutionProvider"],
                    batch_sizes=(1, 32),
                    trt_cache_dir=work / "trt",
                    trt_int8=int8,
                )
                start = time.perf_counter()
                t.predict(frames)  # engine build
                figures[f"{name}_build_s"] = time.perf_counter() - start
                rates[name] = 32 / median_seconds(
                    lambda t=t: t.predict(frames), repeats=20, warmup=3
                )
            except Exception as exc:  # report, keep the other figures
                figures[f"{name}_error"] = repr(exc)[:500]
        if "trt_int8" in rates and "cuda_fp32" in rates:
            figures["trt_int8_vs_cuda_fp32_batch32"] = rates["trt_int8"] / rates["cuda_fp32"]
    figures["img_per_s"] = rates
    tables.append(
        markdown_table(["teacher path (batch 32)", "images/s"], [[k, v] for k, v in rates.items()])
    )
    return {"figures": figures, "tables": tables}
