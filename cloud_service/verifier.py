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
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnxruntime as ort
from PIL import Image

from shared.errors import ImageError, ModelError

__all__ = [
    "PROVIDER_PREFERENCE",
    "TeacherModel",
    "choose_providers",
    "decode_image",
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
    ) -> None:
        self.path = Path(path)
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

    def _create_session(
        self, options: ort.SessionOptions, providers: list[str]
    ) -> ort.InferenceSession:
        errors = []
        # Try the best provider first; one that fails to build the session (missing
        # CUDA libraries, an engine build failure) falls back to the next.
        for index in range(len(providers)):
            chain = providers[index:]
            try:
                return ort.InferenceSession(str(self.path), options, providers=chain)
            except Exception as exc:  # onnxruntime raises its own untyped errors
                errors.append(f"{chain[0]}: {exc}")
                log.warning("teacher session with %s failed: %s", chain[0], exc)
        raise ModelError(f"cannot load the teacher {self.path}: " + "; ".join(errors))

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
            (scores,) = self.session.run([self.info.output_name], {self.info.input_name: frames})
        except Exception as exc:  # onnxruntime's errors are not a documented tree
            raise ModelError(f"teacher inference failed: {exc}") from exc
        return np.asarray(scores, dtype=np.float32)

    def predict_many(self, frames: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Score a list of same-shape frames [H, W, 3] as one batch (the batcher's run_batch)."""
        scores = self.predict(np.stack(frames))
        return list(scores)
