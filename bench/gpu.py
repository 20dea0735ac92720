"""GPU benchmarks (run by ``make gpu-check``): kernels against the memory bandwidth peak,
the Triton kernels against preprocessing inside the ONNX graph, teacher TensorRT INT8
against CUDA FP32 at batch 32, CUDA verifier batched against raw.

Bandwidth shares are against the datasheet peak of the device when its name is known,
else against a measured device-to-device copy (reported either way). Skips (with the
reason in its figures) where there is no CUDA device.
"""

from __future__ import annotations

import functools
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


def _copy_gbps(torch: Any, mib: int = 1024) -> float:
    """GB/s of a device-to-device copy (bytes read + written), median of 10."""
    src = torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    samples = []
    for _ in range(10):
        start = time.perf_counter()
        dst.copy_(src)
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return 2 * src.numel() / float(np.median(samples)) / 1e9


def _cuda_seconds(torch: Any, fn: Any, repeats: int = 20) -> float:
    """Median wall seconds of ``fn()`` with the device synchronized around each call."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - start)
    return float(np.median(samples))


def _graph_preprocess_session(mean: tuple[float, ...], std: tuple[float, ...]) -> Any:
    """The preprocessing as an ONNX graph (uint8 NHWC -> normalized float NCHW) on CUDA:
    what the teacher's in-graph preprocessing does, alone."""
    import onnxruntime as ort
    from onnx import TensorProto, helper, numpy_helper

    shift = np.array(mean, np.float32).reshape(1, 1, 1, 3) * np.float32(255.0)
    scale = (1.0 / (np.array(std, np.float32) * np.float32(255.0))).reshape(1, 1, 1, 3)
    graph = helper.make_graph(
        [
            helper.make_node("Cast", ["frames"], ["f"], to=TensorProto.FLOAT),
            helper.make_node("Sub", ["f", "shift"], ["s"]),
            helper.make_node("Mul", ["s", "scale"], ["m"]),
            helper.make_node("Transpose", ["m"], ["pixels"], perm=[0, 3, 1, 2]),
        ],
        "preprocess",
        [helper.make_tensor_value_info("frames", TensorProto.UINT8, ["n", "h", "w", 3])],
        [helper.make_tensor_value_info("pixels", TensorProto.FLOAT, ["n", 3, "h", "w"])],
        [
            numpy_helper.from_array(shift.astype(np.float32), "shift"),
            numpy_helper.from_array(scale.astype(np.float32), "scale"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return ort.InferenceSession(model.SerializeToString(), providers=["CUDAExecutionProvider"])


def _preprocess_vs_graph(torch: Any, batch: int, size: int) -> dict[str, float]:
    """The preprocessing kernel against the same arithmetic as an ONNX graph, both on
    device buffers (no host copies), uint8 [batch, size, size, 3] in, float NCHW out."""
    from kernels import preprocess
    from kernels.preprocess import IMAGENET_MEAN, IMAGENET_STD

    frames = torch.randint(0, 256, (batch, size, size, 3), dtype=torch.uint8, device="cuda")
    out = torch.empty((batch, 3, size, size), dtype=torch.float32, device="cuda")
    session = _graph_preprocess_session(IMAGENET_MEAN, IMAGENET_STD)
    binding = session.io_binding()
    binding.bind_input("frames", "cuda", 0, np.uint8, list(frames.shape), frames.data_ptr())
    binding.bind_output("pixels", "cuda", 0, np.float32, list(out.shape), out.data_ptr())

    def kernel() -> None:
        preprocess.preprocess(frames, (size, size))

    def graph() -> None:
        session.run_with_iobinding(binding)

    kernel_s = _cuda_seconds(torch, kernel)
    graph_s = _cuda_seconds(torch, graph)
    expected = preprocess.preprocess(frames, (size, size))
    graph()
    torch.cuda.synchronize()
    moved = frames.numel() + out.numel() * 4
    return {
        "kernel_ms": kernel_s * 1000,
        "graph_ms": graph_s * 1000,
        "kernel_gb_per_s": moved / kernel_s / 1e9,
        "graph_gb_per_s": moved / graph_s / 1e9,
        "graph_vs_kernel_max_abs_diff": float((out - expected).abs().max()),
    }


def _teacher_paths(torch: Any, work: Path, size: int, batch: int) -> dict[str, float]:
    """The verifier's teacher on CUDA at ``batch``: preprocessing and softmax in the ONNX
    graph (uint8 frames through I/O binding) against the Triton kernel path."""
    from cloud_service.demo_teacher import build_demo_teacher
    from cloud_service.verifier import TeacherModel

    model = build_demo_teacher(work / f"teacher-{size}.onnx", size=size, hidden=2048, seed=0)
    frames = np.random.default_rng(0).integers(0, 255, (batch, size, size, 3), dtype=np.uint8)
    graph = TeacherModel(model, providers=["CUDAExecutionProvider"], gpu_kernels=False)
    kernels = TeacherModel(model, providers=["CUDAExecutionProvider"])
    if kernels.preprocessing != "kernels":
        return {"error": 1.0}
    rates = {
        "graph_img_per_s": batch / median_seconds(lambda: graph.score(frames), repeats=20),
        "kernels_img_per_s": batch / median_seconds(lambda: kernels.score(frames), repeats=20),
    }
    rates["kernels_vs_graph"] = rates["kernels_img_per_s"] / rates["graph_img_per_s"]
    rates["still_kernels"] = float(kernels.preprocessing == "kernels")
    return rates


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
    copy = _copy_gbps(torch)
    datasheet = _peak(figures["device"])
    peak = datasheet or copy
    figures["peak_gb_per_s"] = peak
    figures["peak_source"] = "datasheet" if datasheet else "measured device-to-device copy"
    figures["copy_gb_per_s"] = copy
    from kernels import preprocess, scoring

    for label, result in (
        ("preprocess 32x480x640 -> 224", preprocess.bench()),
        ("scoring 65536x1000", scoring.bench()),
    ):
        share = result["gb_per_s"] / peak
        figures[label] = {**result, "share_of_peak": share}
        rows.append([label, result["gb_per_s"], peak, share, ">= 0.6"])
    tables = [
        markdown_table(["kernel", "GB/s", "peak GB/s", "share", "goal"], rows),
        f"Peak: {peak:.0f} GB/s ({figures['peak_source']}); a device-to-device copy"
        f" measured {copy:.0f} GB/s ({copy / peak:.2f} of the peak).",
    ]

    # The Triton kernels against preprocessing inside the ONNX graph.
    import onnxruntime as ort

    if "CUDAExecutionProvider" in ort.get_available_providers():
        compare_rows: list[list[Any]] = []
        for batch, size in ((32, 224), (256, 224)):
            try:
                pre = _preprocess_vs_graph(torch, batch, size)
            except Exception as exc:  # report, keep the other figures
                figures[f"preprocess_vs_graph_{batch}x{size}_error"] = repr(exc)[:500]
                continue
            figures[f"preprocess_vs_graph_{batch}x{size}"] = pre
            compare_rows.append(
                [
                    f"preprocess only, {batch}x{size}x{size}",
                    pre["graph_ms"],
                    pre["kernel_ms"],
                    pre["graph_ms"] / pre["kernel_ms"],
                    pre["kernel_gb_per_s"] / peak,
                ]
            )
        work_dir = Path(tempfile.mkdtemp(prefix="edgeloop-gpu-paths-"))
        for size in (64, 224):
            try:
                paths = _teacher_paths(torch, work_dir, size, 32)
            except Exception as exc:  # report, keep the other figures
                figures[f"teacher_paths_{size}_error"] = repr(exc)[:500]
                continue
            figures[f"teacher_paths_{size}"] = paths
            if "kernels_vs_graph" in paths:
                compare_rows.append(
                    [
                        f"teacher {size}x{size}, batch 32 (ms per batch)",
                        32 / paths["graph_img_per_s"] * 1000,
                        32 / paths["kernels_img_per_s"] * 1000,
                        paths["kernels_vs_graph"],
                        "-",
                    ]
                )
        tables.append(
            markdown_table(
                ["kernels vs in-graph", "in graph ms", "kernels ms", "speed-up", "kernel share"],
                compare_rows,
            )
        )

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
                    functools.partial(t.predict, frames), repeats=20, warmup=3
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
