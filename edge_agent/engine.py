"""The student behind a small interface: ONNX Runtime with TensorRT > CUDA > CPU.

The agent only sees ``Engine``: ``run(frames) -> scores`` plus what it needs to
describe the model. Keeping it this small is what lets a later model update swap
engines between batches (``MicroBatcher.swap_engine``).

Provider choice: at start, from ``onnxruntime.get_available_providers()`` in the
order TensorRT, CUDA, CPU (or the order given in settings). At run time, a batch
that fails on a GPU provider is retried once on a CPU session built on the spot,
and the engine stays on CPU from then on (logged and shown in status), so a
driver fault degrades the device instead of stopping it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from shared.errors import ModelError
from shared.tasks import task_for

__all__ = ["Engine", "EngineOptions", "OrtEngine", "choose_providers"]

log = logging.getLogger(__name__)

PREFERENCE = ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider")
_SHORT = {
    "TensorrtExecutionProvider": "tensorrt",
    "CUDAExecutionProvider": "cuda",
    "CPUExecutionProvider": "cpu",
}


class Engine(Protocol):
    """What the agent needs from a student model."""

    name: str
    version: str
    labels: list[str]
    input_hw: tuple[int, int]

    @property
    def provider(self) -> str: ...

    def run(self, frames: np.ndarray) -> np.ndarray:
        """uint8 [N, H, W, 3] RGB -> float32 task output: [N, classes] probabilities for
        classification, [N, K, 6] rows for detection (``shared.tasks``)."""
        ...


@dataclass(frozen=True)
class EngineOptions:
    """How to build the ORT session (from AgentSettings)."""

    providers: tuple[str, ...] | None = None  # None: PREFERENCE filtered by what is present
    intra_op_threads: int = 0  # 0: ORT's default (one per core)
    # ORT's intra-op threads spin between batches by default; off, they sleep and leave
    # the cores to the threads that decode the next frames.
    spinning: bool = True
    trt_cache_dir: Path | None = None
    trt_fp16: bool = True
    trt_int8: bool = False
    # Batch sizes the TensorRT profile must cover; empty: 1 .. warmup_batch.
    trt_batch_sizes: tuple[int, ...] = ()
    warmup_runs: int = 3
    warmup_batch: int = 1
    extra: dict[str, Any] = field(default_factory=dict)


def choose_providers(available: list[str], wanted: tuple[str, ...] | None = None) -> list[str]:
    """Providers to try, best first: ``wanted`` (or the preference) that are present, CPU last."""
    order = wanted or PREFERENCE
    chosen = [p for p in order if p in available]
    if "CPUExecutionProvider" not in chosen:
        chosen.append("CPUExecutionProvider")
    return chosen


class OrtEngine:
    """An ONNX Runtime session on the student contract (frames uint8 NHWC -> scores)."""

    def __init__(self, path: Path, options: EngineOptions | None = None) -> None:
        import onnxruntime as ort

        self.path = Path(path)
        self.options = options or EngineOptions()
        if not self.path.is_file():
            raise ModelError(f"student model {self.path} does not exist")
        self._ort = ort
        providers = choose_providers(ort.get_available_providers(), self.options.providers)
        self._session = self._build(providers)
        self._lock = threading.Lock()  # guards the session swap when degrading
        self._degraded = False
        self._read_contract()
        self.warm_up()

    # --- construction ---------------------------------------------------------

    def _session_options(self) -> Any:
        opts = self._ort.SessionOptions()
        if self.options.intra_op_threads:
            opts.intra_op_num_threads = self.options.intra_op_threads
        opts.inter_op_num_threads = 1
        if not self.options.spinning:
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        opts.graph_optimization_level = self._ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        return opts

    def _provider_options(self, providers: list[str]) -> list[Any]:
        result: list[Any] = []
        for name in providers:
            if name == "TensorrtExecutionProvider":
                trt: dict[str, Any] = {
                    "trt_fp16_enable": self.options.trt_fp16,
                    "trt_int8_enable": self.options.trt_int8,
                }
                trt.update(self._trt_profiles())
                if self.options.trt_cache_dir is not None:
                    # Building a TensorRT engine takes minutes on a Jetson: cache it on disk.
                    self.options.trt_cache_dir.mkdir(parents=True, exist_ok=True)
                    trt["trt_engine_cache_enable"] = True
                    trt["trt_engine_cache_path"] = str(self.options.trt_cache_dir)
                    trt["trt_timing_cache_enable"] = True
                    trt["trt_timing_cache_path"] = str(self.options.trt_cache_dir)
                result.append((name, trt))
            else:
                result.append(name)
        return result

    def _trt_profiles(self) -> dict[str, Any]:
        """TensorRT profile shapes from the dynamic axes and batch sizes (empty if none)."""
        from kernels.tensorrt import tensorrt_provider_options

        sizes = self.options.trt_batch_sizes or (1, max(1, self.options.warmup_batch))
        try:
            derived = tensorrt_provider_options(self.path, sizes)
        except (ValueError, OSError) as exc:  # ORT then builds profiles on the fly
            log.warning("no TensorRT profile for %s: %s", self.path, exc)
            return {}
        return {k: v for k, v in derived.items() if k.startswith("trt_profile_")}

    def _build(self, providers: list[str]) -> Any:
        try:
            session = self._ort.InferenceSession(
                str(self.path),
                sess_options=self._session_options(),
                providers=self._provider_options(providers),
            )
        except Exception as exc:  # ORT raises its own untyped errors; wrap once here
            if providers != ["CPUExecutionProvider"]:
                log.warning(
                    "student session on %s failed (%s); falling back to CPU", providers, exc
                )
                return self._build(["CPUExecutionProvider"])
            raise ModelError(f"cannot load student model {self.path}: {exc}") from exc
        return session

    def _read_contract(self) -> None:
        inputs = {i.name: i for i in self._session.get_inputs()}
        outputs = {o.name: o for o in self._session.get_outputs()}
        meta = self._session.get_modelmeta().custom_metadata_map
        try:  # a model of a task this agent does not know is refused, not misread
            task = task_for(meta.get("edgeloop.task"))
        except ValueError as exc:
            raise ModelError(f"{self.path}: {exc}") from None
        self.task = task.name
        self.output_name = output = task.output_name
        if "frames" not in inputs or output not in outputs:
            raise ModelError(
                f"{self.path} does not follow the student contract of the {task.name} task:"
                f" expected input 'frames' and output {output!r}, found inputs"
                f" {sorted(inputs)} outputs {sorted(outputs)}; wrap a model of another"
                " contract with `edgeloop models import`"
            )
        shape = inputs["frames"].shape
        if inputs["frames"].type != "tensor(uint8)" or len(shape) != 4 or shape[3] != 3:
            raise ModelError(
                f"{self.path}: input 'frames' must be uint8 [batch, H, W, 3], got"
                f" {inputs['frames'].type} {shape}; `edgeloop models import` wraps a float32"
                " or NCHW model with its preprocessing"
            )
        if not isinstance(shape[1], int) or not isinstance(shape[2], int):
            raise ModelError(f"{self.path}: input 'frames' needs a fixed H and W, got {shape}")
        self.input_hw = (int(shape[1]), int(shape[2]))
        # A classifier's classes are its scores' width; a detector's rows do not say.
        classes = outputs[output].shape[1] if output == "scores" else None
        labels: list[str] | None = None
        if "edgeloop.labels" in meta:
            try:
                parsed = json.loads(meta["edgeloop.labels"])
            except ValueError as exc:
                raise ModelError(f"{self.path}: edgeloop.labels is not JSON") from exc
            if isinstance(parsed, list):
                labels = [str(x) for x in parsed]
        if labels is None and classes is None:
            raise ModelError(f"{self.path}: a {task.name} model must name its edgeloop.labels")
        if labels is None:
            if not isinstance(classes, int):
                probe = self._session.run(["scores"], {"frames": self._blank(1)})[0]
                classes = int(probe.shape[1])
            labels = [str(i) for i in range(classes)]
        self.labels = labels
        self.name = meta.get("edgeloop.name") or self.path.stem
        self.version = meta.get("edgeloop.version") or _sha_prefix(self.path)

    def _blank(self, batch: int) -> np.ndarray:
        h, w = getattr(self, "input_hw", (1, 1))
        return np.zeros((batch, h, w, 3), dtype=np.uint8)

    def warm_up(self) -> None:
        """Run a few batches so the first real frame does not pay for lazy initialisation."""
        for batch in {1, max(1, self.options.warmup_batch)}:
            for _ in range(self.options.warmup_runs):
                self.run(self._blank(batch))

    # --- running ---------------------------------------------------------------

    @property
    def provider(self) -> str:
        return _SHORT.get(self._session.get_providers()[0], self._session.get_providers()[0])

    @property
    def degraded(self) -> bool:
        return self._degraded

    def run(self, frames: np.ndarray) -> np.ndarray:
        session = self._session
        try:
            return np.asarray(
                session.run([self.output_name], {"frames": frames})[0], dtype=np.float32
            )
        except Exception as exc:
            if session.get_providers()[0] == "CPUExecutionProvider":
                raise ModelError(
                    f"student model failed on a batch of {len(frames)}: {exc}"
                ) from exc
            self._degrade(session, exc)
            return self.run(frames)

    def _degrade(self, failed: Any, exc: Exception) -> None:
        with self._lock:
            if self._session is not failed:
                return  # another thread already degraded
            log.error("student failed on %s (%s): degrading to CPU", failed.get_providers()[0], exc)
            self._session = self._build(["CPUExecutionProvider"])
            self._degraded = True


def _sha_prefix(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()[:12]
