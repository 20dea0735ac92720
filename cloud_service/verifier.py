"""The teacher in ONNX Runtime: provider choice, image preprocessing, batched scoring.

Model contract (shared with distill/): input ``frames`` uint8 [batch, H, W, 3] RGB
(preprocessing inside the graph, dynamic batch axis), output ``scores`` float32
[batch, classes] probabilities. Class labels come from the metadata key
``edgeloop.labels`` (a JSON list) when present, else "0".."C-1".

Two ways to run a batch:

* *graph* (every provider): uint8 frames go into the session as they are; on CUDA
  through I/O binding into pre-allocated device buffers.
* *kernels* (CUDA, with triton and torch): the frames are copied to the GPU once,
  the Triton preprocessing kernel makes the normalized NCHW tensor, the teacher
  without its in-graph preprocessing and softmax (``kernels.graph.split_teacher``)
  runs on it through I/O binding, and the Triton scoring kernel turns its logits
  into probabilities, confidence, margin and entropy in one pass. Chosen at start
  where possible (``use_gpu_kernels``); a failure at run time falls back to *graph*.
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
from typing import TYPE_CHECKING, Any, NamedTuple

import cv2
import numpy as np
import onnxruntime as ort
from PIL import Image

from shared.decode_pool import DecodePool
from shared.errors import ImageError, ImageFormatError, ModelError
from shared.images import DecodeCost, ImageInfo, decode_cost, probe_image
from shared.imdecode import decode_rgb
from shared.tasks import Answer, ClassificationTask, task_for

if TYPE_CHECKING:
    from kernels.graph import TeacherSplit

__all__ = [
    "PROVIDER_PREFERENCE",
    "BatchScores",
    "TeacherModel",
    "TeacherScore",
    "choose_providers",
    "decode_image",
    "scores_from_probs",
    "use_gpu_kernels",
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


def decode_image(
    data: bytes,
    size: tuple[int, int] | None,
    *,
    pool: DecodePool | None = None,
    probed: tuple[ImageInfo, DecodeCost] | None = None,
) -> np.ndarray:
    """Decode JPEG/PNG bytes to uint8 [H, W, 3] RGB, resized to ``size`` (H, W) if given.

    OpenCV decodes (it releases the GIL, so a thread pool spreads decoding over the
    cores), at a reduced scale when the image is at least twice the target, then
    shrinks with the area filter. Bytes OpenCV refuses, and JPEGs that do not end
    with their end-of-image marker, go through Pillow, which either decodes them or
    says what is wrong with them. With a ``pool``, the images it isolates (progressive
    JPEGs, costly ones) are decoded in its worker processes within its time budget:
    ImageDecodeTimeoutError past it, ImageDecodeFailedError when the decoder crashes.
    ``probed``: the image's ``probe_image`` and ``decode_cost``, when the caller has them.
    """
    cost: DecodeCost | None = None
    if probed is not None:
        info, cost = probed
    else:
        try:
            info = probe_image(data)
        except ImageFormatError as exc:
            raise ImageError(f"image bytes do not decode as JPEG/PNG: {exc}") from exc
    if pool is not None and pool.isolates(cost or decode_cost(data, info)):
        return pool.run(_decode_pixels, data, info, size)
    return _decode_pixels(data, info, size)


def _decode_pixels(data: bytes, info: ImageInfo, size: tuple[int, int] | None) -> np.ndarray:
    """``decode_image`` of probed bytes, in this process."""
    rgb = decode_rgb(data, info, size)  # reduced while >= size, RGB; None: refused
    if rgb is None:  # Pillow names the problem (a truncated JPEG), or reads the image
        rgb = _decode_with_pillow(data)
    if size is not None and rgb.shape[:2] != size:
        shrinking = rgb.shape[0] > size[0] or rgb.shape[1] > size[1]
        interpolation = cv2.INTER_AREA if shrinking else cv2.INTER_LINEAR
        # The output array is made here: one OpenCV allocates goes through numpy, which
        # takes the interpreter lock in the middle of the call (a wait, under load).
        out = np.empty((*size, 3), np.uint8)
        rgb = cv2.resize(rgb, (size[1], size[0]), dst=out, interpolation=interpolation)
    return np.ascontiguousarray(rgb, dtype=np.uint8)


def _decode_with_pillow(data: bytes) -> np.ndarray:
    try:
        with warnings.catch_warnings():
            # A decompression-bomb warning is an error here: the envelope limits
            # already bounded the pixel count, so anything Pillow warns about is refused.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                image.load()
                return np.asarray(image.convert("RGB"), dtype=np.uint8)
    except (
        OSError,
        ValueError,
        SyntaxError,
        Image.DecompressionBombError,
        Image.DecompressionBombWarning,
    ) as exc:
        raise ImageError(f"image bytes do not decode as JPEG/PNG: {exc}") from exc


class BatchScores(NamedTuple):
    """The teacher's answer for a batch: probabilities and what the verdict needs from them."""

    probs: np.ndarray  # float32 [N, C]
    label: np.ndarray  # int [N] the most probable class
    confidence: np.ndarray  # float32 [N] its probability
    margin: np.ndarray  # float32 [N] best minus second-best probability
    entropy: np.ndarray  # float32 [N] nats


class TeacherScore(NamedTuple):
    """One frame's row of ``BatchScores``; a detector's answer also whole (``answer``)."""

    scores: np.ndarray
    label: int
    confidence: float
    margin: float
    entropy: float
    answer: Answer | None = None


def scores_from_probs(probs: np.ndarray) -> BatchScores:
    """Label, confidence, margin and entropy of probabilities [N, C] (NumPy, any device)."""
    probs = np.asarray(probs, dtype=np.float32)
    label = probs.argmax(axis=1)
    rows = np.arange(len(probs))
    confidence = probs[rows, label]
    if probs.shape[1] > 1:
        second = np.partition(probs, -2, axis=1)[:, -2]
    else:
        second = np.zeros_like(confidence)
    # p log p is 0 at p = 0; the floor keeps log() finite there.
    logs = np.log(np.maximum(probs, np.finfo(np.float32).tiny))
    entropy = -(probs * logs).sum(axis=1, dtype=np.float32)
    return BatchScores(probs, label, confidence, confidence - second, entropy)


def use_gpu_kernels(provider: str, *, wanted: bool, cuda: bool, triton: bool) -> bool:
    """Whether a session on ``provider`` runs with the Triton kernels around it: only on
    CUDA (TensorRT fuses the preprocessing itself; CPU keeps the in-graph path)."""
    return wanted and cuda and triton and provider == "CUDAExecutionProvider"


def _cuda_and_triton() -> tuple[bool, bool]:
    try:
        import torch
    except ImportError:
        return False, False
    from kernels import preprocess

    return bool(torch.cuda.is_available()), preprocess.HAVE_TRITON


class _KernelPath:
    """uint8 frames -> preprocessing kernel -> split teacher (I/O binding) -> scoring kernel.

    Every tensor stays on ``device`` ("cuda"; "cpu" runs the same code in Triton's
    interpreter) from the one host-to-device copy of the frames to the copy of the
    scores back.
    """

    def __init__(
        self,
        split: TeacherSplit,
        session: ort.InferenceSession,
        *,
        size: tuple[int, int] | None,
        classes: int,
        device: str,
    ) -> None:
        self.split = split
        self.session = session
        self.size = size
        self.classes = classes
        self.device = device

    def run(self, frames: np.ndarray) -> BatchScores:
        import torch

        from kernels import preprocess, scoring

        device = torch.device(self.device)
        host = np.ascontiguousarray(frames)
        if not host.flags.writeable:  # torch wants memory it may write
            host = host.copy()
        x = torch.from_numpy(host).to(device)
        size = self.size or (int(frames.shape[1]), int(frames.shape[2]))
        pixels = preprocess.preprocess(x, size, mean=self.split.mean, std=self.split.std)
        n = int(pixels.shape[0])
        out = torch.empty((n, self.classes), dtype=torch.float32, device=device)
        kind, index = device.type, device.index or 0
        binding = self.session.io_binding()
        binding.bind_input(
            self.split.input_name, kind, index, np.float32, list(pixels.shape), pixels.data_ptr()
        )
        binding.bind_output(
            self.split.output_name, kind, index, np.float32, [n, self.classes], out.data_ptr()
        )
        if kind == "cuda":
            # The kernel ran on torch's stream and ONNX Runtime runs on its own.
            torch.cuda.current_stream(device).synchronize()
        self.session.run_with_iobinding(binding)
        if not self.split.logits:
            return scores_from_probs(out.cpu().numpy())
        result = scoring.score(out)
        return BatchScores(
            result.probs.cpu().numpy(),
            result.top1.cpu().numpy().astype(np.int64),
            result.confidence.cpu().numpy(),
            result.margin.cpu().numpy(),
            result.entropy.cpu().numpy(),
        )


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
    task: str = "classification"  # ONNX metadata ``edgeloop.task`` (shared.tasks)


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
        allow_spinning: bool = False,
        gpu_kernels: bool = True,
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
        # Idle intra-op threads spin for work by default: fast for a process that only
        # runs the model, but here they take the cores that decode and store samples.
        options.add_session_config_entry(
            "session.intra_op.allow_spinning", "1" if allow_spinning else "0"
        )
        self.session = self._create_session(options, choose_providers(providers))
        self.info = self._inspect(name, version)
        # The task reads the teacher's outputs; a classifier's have a faster path of
        # their own (scores_from_probs, and the GPU preprocessing kernels).
        self.task = task_for(self.info.task)
        self._classifier = isinstance(self.task, ClassificationTask)
        self._binding: _CudaBinding | None = None
        if uses_io_binding(self.info.provider):
            out = next(o for o in self.session.get_outputs() if o.name == self.info.output_name)
            width = out.shape[1] if len(out.shape) == 2 else None
            self._binding = _CudaBinding(
                self.session, self.info, width if isinstance(width, int) else None
            )
        self._kernels: _KernelPath | None = None
        # torch and triton are imported only where they can be used (~300 MB resident).
        on_cuda = gpu_kernels and self._classifier and self.info.provider == "CUDAExecutionProvider"
        cuda, triton = _cuda_and_triton() if on_cuda else (False, False)
        if use_gpu_kernels(self.info.provider, wanted=gpu_kernels, cuda=cuda, triton=triton):
            self._kernels = self._kernel_path(options, device="cuda")

    @property
    def preprocessing(self) -> str:
        """Where preprocessing runs: "kernels" (Triton, on the GPU) or "graph" (in ONNX)."""
        return "kernels" if self._kernels is not None else "graph"

    def _kernel_path(self, options: ort.SessionOptions, *, device: str) -> _KernelPath | None:
        """The kernel path on ``device``, or None (logged) where the teacher does not split."""
        from kernels.graph import split_teacher

        out = next(o for o in self.session.get_outputs() if o.name == self.info.output_name)
        classes = out.shape[1] if len(out.shape) == 2 else None
        if not isinstance(classes, int):
            log.info("teacher keeps in-graph preprocessing: its class count is not fixed")
            return None
        try:
            split = split_teacher(self.path, self.info.output_name)
            if split is None:
                return None
            provider = "CUDAExecutionProvider" if device == "cuda" else "CPUExecutionProvider"
            session = ort.InferenceSession(split.model, options, providers=[provider])
        except Exception as exc:  # onnx/onnxruntime errors are untyped: keep the graph path
            log.warning("teacher keeps in-graph preprocessing: %s", exc)
            return None
        log.info("teacher preprocessing and scoring run as Triton kernels on %s", device)
        return _KernelPath(split, session, size=self.input_size, classes=classes, device=device)

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
                " expected uint8 [N, H, W, 3]; `edgeloop models import --role teacher` wraps"
                " a float32 or NCHW model with its preprocessing"
            )
        meta = self.session.get_modelmeta().custom_metadata_map
        try:
            answers = task_for(meta.get("edgeloop.task"))
        except ValueError as exc:
            raise ModelError(f"teacher {name}: {exc}") from None
        out = next((o for o in outputs if o.name == answers.output_name), outputs[0])
        classes = out.shape[1] if len(out.shape) == 2 and isinstance(out.shape[1], int) else None
        if out.name != "scores" and classes is not None:
            classes = None  # a detector's rows do not count its classes
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
        task = answers.name
        return ModelInfo(
            name=name,
            version=version or meta.get("edgeloop.version", "1"),
            input_name=inputs[0].name,
            output_name=out.name,
            height=shape[1] if isinstance(shape[1], int) else None,
            width=shape[2] if isinstance(shape[2], int) else None,
            labels=tuple(labels),
            provider=self.session.get_providers()[0],
            task=task,
        )

    @property
    def input_size(self) -> tuple[int, int] | None:
        """(H, W) the model wants, or None when both axes are dynamic."""
        if self.info.height is None or self.info.width is None:
            return None
        return (self.info.height, self.info.width)

    def predict(self, frames: np.ndarray) -> np.ndarray:
        """Scores float32 [N, C] for frames uint8 [N, H, W, 3]."""
        if self._kernels is not None:
            return self.score(frames).probs
        return self._predict_graph(frames)

    def _predict_graph(self, frames: np.ndarray) -> np.ndarray:
        try:
            if self._binding is not None:
                return self._binding.run(frames)
            (scores,) = self.session.run([self.info.output_name], {self.info.input_name: frames})
        except Exception as exc:  # onnxruntime's errors are not a documented tree
            raise ModelError(f"teacher inference failed: {exc}") from exc
        return np.asarray(scores, dtype=np.float32)

    def score(self, frames: np.ndarray) -> BatchScores:
        """Probabilities, label, confidence, margin and entropy for frames uint8 [N, H, W, 3]."""
        kernels = self._kernels
        if kernels is not None:
            try:
                return kernels.run(frames)
            except Exception as exc:  # triton/torch/onnxruntime: degrade, keep serving
                log.warning("GPU kernels failed (%s); preprocessing moves into the graph", exc)
                self._kernels = None
        return scores_from_probs(self._predict_graph(frames))

    def predict_many(self, frames: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Score a list of same-shape frames [H, W, 3] as one batch (the batcher's run_batch)."""
        scores = self.predict(np.stack(frames))
        return list(scores)

    def score_many(self, frames: Sequence[np.ndarray]) -> list[TeacherScore]:
        """``score`` for a list of same-shape frames [H, W, 3], one result per frame."""
        if not self._classifier:
            return [
                TeacherScore(np.asarray(a.scores, np.float32), a.label, a.confidence, 0.0, 0.0, a)
                for a in self.task.answers(self._predict_graph(np.stack(frames)))
            ]
        result = self.score(np.stack(frames))
        return [
            TeacherScore(probs, int(label), float(confidence), float(margin), float(entropy))
            for probs, label, confidence, margin, entropy in zip(
                result.probs,
                result.label.tolist(),
                result.confidence.tolist(),
                result.margin.tolist(),
                result.entropy.tolist(),
                strict=True,
            )
        ]
