"""The teacher in ONNX Runtime: provider choice, image preprocessing, batched scoring.

Model contract (shared with distill/): input ``frames`` uint8 [batch, H, W, 3] RGB
(preprocessing inside the graph, dynamic batch axis), output ``scores`` float32
[batch, classes] probabilities. Class labels come from the metadata key
``edgeloop.labels`` (a JSON list) when present, else "0".."C-1".
"""

from __future__ import annotations

import io
import json
import logging
import threading
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from PIL import Image

from shared.errors import ImageError, ModelError

__all__ = [
    "PROVIDER_PREFERENCE",
    "TeacherModel",
    "choose_providers",
    "decode_image",
    "uses_io_binding",
]

log = logging.getLogger(__name__)

PROVIDER_PREFERENCE = (
    "TensorrtExecutionProvider",
    "CUDAExecutionProvider",
    "CPUExecutionProvider",
)


def choose_providers(wanted: Sequence[str] | None = None) -> list[str]:
    """The providers to try, best first, among those this onnxruntime build has."""
    available = set(ort.get_available_providers())
    order = list(wanted) if wanted else list(PROVIDER_PREFERENCE)
    chosen = [p for p in order if p in available]
    if "CPUExecutionProvider" not in chosen:
        chosen.append("CPUExecutionProvider")
    return chosen


def decode_image(data: bytes, size: tuple[int, int] | None) -> np.ndarray:
    """Decode JPEG/PNG bytes to uint8 [H, W, 3] RGB, resized to ``size`` (H, W) if given."""
    try:
        with warnings.catch_warnings():
            # A decompression-bomb warning is an error here: the envelope limits
            # already bounded the pixel count, so anything Pillow warns about is refused.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                if size is not None and image.format == "JPEG":
                    # Let libjpeg decode at 1/2, 1/4 or 1/8 scale (DCT scaling) when the
                    # target is that much smaller: a 208 px camera crop for a 64 px
                    # teacher decodes ~2x faster, and decode was ingest's largest cost.
                    image.draft("RGB", (size[1], size[0]))
                image.load()
                rgb = image.convert("RGB")
                if size is not None and (rgb.height, rgb.width) != size:
                    rgb = rgb.resize((size[1], size[0]), Image.Resampling.BILINEAR)
                return np.asarray(rgb, dtype=np.uint8)
    except (
        OSError,
        ValueError,
        SyntaxError,
        Image.DecompressionBombError,
        Image.DecompressionBombWarning,
    ) as exc:
        raise ImageError(f"image bytes do not decode as JPEG/PNG: {exc}") from exc


def uses_io_binding(provider: str) -> bool:
    """Whether the session's provider gets I/O binding with pre-allocated device buffers."""
    return provider == "CUDAExecutionProvider"


class _CudaBinding:
    """I/O binding on CUDA: per-thread, per-shape device buffers allocated once and reused,
    so a batch costs one host-to-device copy in, the run, and one copy out."""

    _MAX_SHAPES = 64  # batch sizes 1..max_batch per input shape; bounds device memory

    def __init__(self, session: ort.InferenceSession, info: ModelInfo, classes: int | None):
        self.session = session
        self.info = info
        self.classes = classes
        self._local = threading.local()

    def run(self, frames: np.ndarray) -> np.ndarray:
        cache: dict[tuple[int, ...], tuple[Any, Any, Any]] = self._local.__dict__.setdefault(
            "cache", {}
        )
        key = tuple(frames.shape)
        entry = cache.get(key)
        if entry is None:
            if len(cache) >= self._MAX_SHAPES:
                cache.clear()
            value_in = ort.OrtValue.ortvalue_from_shape_and_type(list(key), np.uint8, "cuda", 0)
            binding = self.session.io_binding()
            binding.bind_ortvalue_input(self.info.input_name, value_in)
            value_out = None
            if self.classes is not None:
                value_out = ort.OrtValue.ortvalue_from_shape_and_type(
                    [key[0], self.classes], np.float32, "cuda", 0
                )
                binding.bind_ortvalue_output(self.info.output_name, value_out)
            else:  # unknown output width: ORT allocates it on the device each run
                binding.bind_output(self.info.output_name, "cuda")
            entry = cache[key] = (value_in, value_out, binding)
        value_in, value_out, binding = entry
        value_in.update_inplace(np.ascontiguousarray(frames))
        self.session.run_with_iobinding(binding)
        if value_out is not None:
            return np.asarray(value_out.numpy(), dtype=np.float32)
        return np.asarray(binding.copy_outputs_to_cpu()[0], dtype=np.float32)


@dataclass(frozen=True)
class ModelInfo:
    name: str
    version: str
    input_name: str
    output_name: str
    height: int | None
    width: int | None
    labels: tuple[str, ...]
    provider: str


class TeacherModel:
    """An ONNX Runtime session of the teacher; ``predict`` scores a batch of frames."""

    def __init__(
        self,
        path: Path,
        *,
        name: str = "teacher",
        version: str | None = None,
        providers: Sequence[str] | None = None,
        intra_op_threads: int = 0,
        batch_sizes: Sequence[int] = (1, 32),
        trt_cache_dir: Path | None = None,
        trt_fp16: bool = True,
        trt_int8: bool = False,
    ) -> None:
        self.path = Path(path)
        self._batch_sizes = tuple(batch_sizes)
        self._trt_cache_dir = trt_cache_dir
        self._trt_fp16 = trt_fp16
        self._trt_int8 = trt_int8
        if not self.path.is_file():
            raise ModelError(
                f"teacher model {self.path} does not exist: set EDGELOOP_TEACHER_MODEL to an"
                " ONNX file with input 'frames' uint8 [N,H,W,3] and output 'scores'"
            )
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if intra_op_threads:
            options.intra_op_num_threads = intra_op_threads
        self.session = self._create_session(options, choose_providers(providers))
        self.info = self._inspect(name, version)
        self._binding: _CudaBinding | None = None
        if uses_io_binding(self.info.provider):
            out = next(o for o in self.session.get_outputs() if o.name == self.info.output_name)
            width = out.shape[1] if len(out.shape) == 2 else None
            self._binding = _CudaBinding(
                self.session, self.info, width if isinstance(width, int) else None
            )

    def _create_session(
        self, options: ort.SessionOptions, providers: list[str]
    ) -> ort.InferenceSession:
        errors = []
        # Try the best provider first; one that fails to build the session (missing
        # CUDA libraries, an engine build failure) falls back to the next.
        for index in range(len(providers)):
            chain = providers[index:]
            try:
                return ort.InferenceSession(
                    str(self.path), options, providers=self._with_options(chain)
                )
            except Exception as exc:  # onnxruntime raises its own untyped errors
                errors.append(f"{chain[0]}: {exc}")
                log.warning("teacher session with %s failed: %s", chain[0], exc)
        raise ModelError(f"cannot load the teacher {self.path}: " + "; ".join(errors))

    def _with_options(self, chain: list[str]) -> list[Any]:
        """TensorRT gets profiles from the model's dynamic axes and the batch sizes."""
        if chain[0] != "TensorrtExecutionProvider":
            return list(chain)
        from kernels.tensorrt import tensorrt_provider_options

        try:
            trt = tensorrt_provider_options(
                self.path,
                self._batch_sizes,
                cache_dir=self._trt_cache_dir,
                fp16=self._trt_fp16,
                int8=self._trt_int8,
            )
        except ValueError as exc:  # ORT then builds profiles on the fly
            log.warning("no TensorRT profile for the teacher: %s", exc)
            trt = {"trt_fp16_enable": self._trt_fp16, "trt_int8_enable": self._trt_int8}
        return [("TensorrtExecutionProvider", trt), *chain[1:]]

    def _inspect(self, name: str, version: str | None) -> ModelInfo:
        inputs = self.session.get_inputs()
        outputs = self.session.get_outputs()
        if len(inputs) != 1 or len(outputs) < 1:
            raise ModelError("the teacher must have one input (frames) and an output (scores)")
        shape = inputs[0].shape
        if inputs[0].type != "tensor(uint8)" or len(shape) != 4 or shape[3] != 3:
            raise ModelError(
                f"teacher input {inputs[0].name} is {inputs[0].type} {shape}:"
                " expected uint8 [N, H, W, 3]"
            )
        out = next((o for o in outputs if o.name == "scores"), outputs[0])
        classes = out.shape[1] if len(out.shape) == 2 and isinstance(out.shape[1], int) else None
        meta = self.session.get_modelmeta().custom_metadata_map
        labels: list[str] | None = None
        if "edgeloop.labels" in meta:
            try:
                parsed = json.loads(meta["edgeloop.labels"])
                if isinstance(parsed, list):
                    labels = [str(x) for x in parsed]
            except ValueError:
                log.warning("teacher metadata edgeloop.labels is not JSON; using indices")
        if labels is None:
            labels = [str(i) for i in range(classes or 0)]
        return ModelInfo(
            name=name,
            version=version or meta.get("edgeloop.version", "1"),
            input_name=inputs[0].name,
            output_name=out.name,
            height=shape[1] if isinstance(shape[1], int) else None,
            width=shape[2] if isinstance(shape[2], int) else None,
            labels=tuple(labels),
            provider=self.session.get_providers()[0],
        )

    @property
    def input_size(self) -> tuple[int, int] | None:
        """(H, W) the model wants, or None when both axes are dynamic."""
        if self.info.height is None or self.info.width is None:
            return None
        return (self.info.height, self.info.width)

    def predict(self, frames: np.ndarray) -> np.ndarray:
        """Scores float32 [N, C] for frames uint8 [N, H, W, 3]."""
        try:
            if self._binding is not None:
                return self._binding.run(frames)
            (scores,) = self.session.run([self.info.output_name], {self.info.input_name: frames})
        except Exception as exc:  # onnxruntime's errors are not a documented tree
            raise ModelError(f"teacher inference failed: {exc}") from exc
        return np.asarray(scores, dtype=np.float32)

    def predict_many(self, frames: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Score a list of same-shape frames [H, W, 3] as one batch (the batcher's run_batch)."""
        scores = self.predict(np.stack(frames))
        return list(scores)
