"""The reference detectors (PyTorch): an anchor-free, CenterNet-style student and teacher.

Both networks map normalised NCHW frames (``(pixel - 128) / 64``, as the classifiers
in ``distill.models``) to three maps at output stride 8: per-class heatmap logits,
box size and centre offset. An object is a peak of its class's heatmap; the cell
holding its centre carries the box's width and height (in cells) and the centre's
sub-cell offset. No anchors, no NMS: a 3x3 max-pool keeps the local maxima.

``FramesDetector`` wraps a network into the deployable contract of
``shared.tasks.detection``: uint8 NHWC RGB frames in, ``detections`` out, float32
``[batch, K, 6]`` rows ``x1, y1, x2, y2, score, class`` with the corners as fractions
of the frame, sorted by score, rows beyond the frame's peaks all zero. Preprocessing
and decoding (peak extraction, TopK over classes x cells, gathers) are inside the
module, so the exported ONNX graph is the whole detector.

Student design: a 4x4/4 patchify stem (a uint8 camera byte is the quantized form of
the normalised input, so the INT8 student reads frames straight into its first
convolution, and a 3-channel 3x3 stem is slow in INT8), one strided 3x3 to stride 8,
then 3x3 convolutions with growing dilation so the centre cell sees a whole digit
(up to about 80 px) without a deeper, costlier pyramid. One shared 1x1 trunk feeds a
single 1x1 projection to the heatmap, size and offset channels.

Teacher design: a wider, deeper backbone down to stride 16 for context, merged back
into stride 8 (nearest upsampling plus a lateral 1x1, as in a one-level FPN), and
separate 3x3 heads for the heatmap and the box regression.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from distill._io import atomic_path
from distill.models import INPUT_SCALE, INPUT_ZERO_POINT
from shared.errors import ModelError

__all__ = [
    "DETECTOR_ARCHITECTURES",
    "MAX_DETECTIONS",
    "OUTPUT_STRIDE",
    "DetArch",
    "DetectorMeta",
    "FramesDetector",
    "LoadedDetector",
    "StudentDetector",
    "TeacherDetector",
    "build_detector",
    "decode_detections",
    "detector_profile",
    "load_detector",
    "net_detections",
    "save_detector",
    "split_maps",
]

DetArch = Literal["student-det", "teacher-det"]
DETECTOR_ARCHITECTURES: tuple[DetArch, ...] = ("student-det", "teacher-det")
OUTPUT_STRIDE = 8
MAX_DETECTIONS = 50  # K: rows per frame in the exported ``detections``
# Heatmap bias at start: sigmoid(-2.19) = 0.1, so the focal loss does not begin
# swamped by thousands of confident false peaks (CenterNet's initialisation).
_HEAT_PRIOR_BIAS = -2.19
_CHECKPOINT_FORMAT = "edgeloop-detector"
_CHECKPOINT_VERSION = 1


class _ConvBNReLU(nn.Sequential):
    """Conv (no bias) -> BatchNorm -> ReLU; ``distill.models.fuse_conv_bn`` folds the BN."""

    def __init__(
        self, cin: int, cout: int, kernel: int, stride: int = 1, dilation: int = 1
    ) -> None:
        padding = dilation * (kernel // 2) if kernel % 2 else 0
        super().__init__(
            nn.Conv2d(cin, cout, kernel, stride, padding, dilation=dilation, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
        )


def _ch(base: int, width: float) -> int:
    # Multiples of 8 keep the INT8 and SIMD kernels on their fast paths.
    return max(8, round(base * width / 8) * 8)


def _init_outputs(heat: nn.Conv2d, regress: nn.Conv2d | None = None) -> None:
    if heat.bias is not None:
        nn.init.constant_(heat.bias[: heat.out_channels], _HEAT_PRIOR_BIAS)
    if regress is not None and regress.bias is not None:
        nn.init.zeros_(regress.bias)


class StudentDetector(nn.Module):
    """Edge student: 4x4/4 patchify stem, 3x3/2, dilated 3x3s at stride 8, one 1x1 head.

    ``forward`` returns ``[B, C + 4, H/8, W/8]``: heatmap logits, then (w, h) in cells,
    then (dx, dy) offsets; ``split_maps`` takes them apart.
    """

    def __init__(self, num_classes: int, width: float = 1.0) -> None:
        super().__init__()
        c1, c2, c3 = (_ch(b, width) for b in (24, 48, 64))
        self.num_classes = num_classes
        self.features = nn.Sequential(
            _ConvBNReLU(3, c1, 4, 4),  # [B, c1, H/4, W/4]
            _ConvBNReLU(c1, c2, 3, 2),  # [B, c2, H/8, W/8]
            _ConvBNReLU(c2, c3, 3),
            _ConvBNReLU(c3, c3, 3, dilation=2),
            _ConvBNReLU(c3, c3, 3, dilation=4),
            _ConvBNReLU(c3, c3, 1),
        )
        self.out = nn.Conv2d(c3, num_classes + 4, 1)
        with torch.no_grad():
            assert self.out.bias is not None
            self.out.bias.zero_()
            self.out.bias[:num_classes] = _HEAT_PRIOR_BIAS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.features(x))  # [B, C + 4, H/8, W/8]


class TeacherDetector(nn.Module):
    """Teacher: 3x3 backbone to stride 16, merged into stride 8, separate 3x3 heads."""

    def __init__(self, num_classes: int, width: float = 1.0) -> None:
        super().__init__()
        c1, c2, c3, c4, ch = (_ch(b, width) for b in (32, 64, 96, 128, 64))
        self.num_classes = num_classes
        self.stride8 = nn.Sequential(
            _ConvBNReLU(3, c1, 3, 2),  # [B, c1, H/2, W/2]
            _ConvBNReLU(c1, c2, 3, 2),  # [B, c2, H/4, W/4]
            _ConvBNReLU(c2, c3, 3, 2),  # [B, c3, H/8, W/8]
            _ConvBNReLU(c3, c3, 3),
        )
        self.stride16 = nn.Sequential(
            _ConvBNReLU(c3, c4, 3, 2),  # [B, c4, H/16, W/16]
            _ConvBNReLU(c4, c4, 3),
            _ConvBNReLU(c4, c4, 3, dilation=2),
        )
        self.lateral = nn.Conv2d(c3, c4, 1)
        self.merge = _ConvBNReLU(c4, c3, 3)  # [B, c3, H/8, W/8]
        self.heat = nn.Sequential(_ConvBNReLU(c3, ch, 3), nn.Conv2d(ch, num_classes, 1))
        self.box = nn.Sequential(_ConvBNReLU(c3, ch, 3), nn.Conv2d(ch, 4, 1))
        heat_out, box_out = self.heat[1], self.box[1]
        assert isinstance(heat_out, nn.Conv2d) and isinstance(box_out, nn.Conv2d)
        _init_outputs(heat_out, box_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s8 = self.stride8(x)
        s16 = self.stride16(s8)
        # Nearest upsampling to the stride-8 grid (its size, for frames not a multiple of 16).
        up = F.interpolate(s16, size=s8.shape[-2:], mode="nearest")  # [B, c4, H/8, W/8]
        merged = self.merge(up + self.lateral(s8))
        return torch.cat([self.heat(merged), self.box(merged)], dim=1)  # [B, C + 4, h, w]


def build_detector(arch: str, num_classes: int, width: float = 1.0) -> nn.Module:
    if num_classes < 1:
        raise ModelError(f"a detector needs at least 1 class, got {num_classes}")
    if width <= 0:
        raise ModelError(f"width must be > 0, got {width}")
    if arch == "student-det":
        return StudentDetector(num_classes, width)
    if arch == "teacher-det":
        return TeacherDetector(num_classes, width)
    raise ModelError(
        f"unknown detector architecture {arch!r}; expected one of"
        f" {', '.join(DETECTOR_ARCHITECTURES)}"
    )


def split_maps(
    maps: torch.Tensor, num_classes: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[B, C + 4, h, w]`` -> heatmap logits [B, C, h, w], size and offset [B, 2, h, w]."""
    return maps[:, :num_classes], maps[:, num_classes : num_classes + 2], maps[:, num_classes + 2 :]


def decode_detections(
    maps: torch.Tensor,
    num_classes: int,
    frame_size: tuple[int, int],
    *,
    k: int = MAX_DETECTIONS,
    stride: int = OUTPUT_STRIDE,
) -> torch.Tensor:
    """Network maps -> ``[B, K, 6]`` rows (fractional xyxy, score, class), best first.

    A detection is a cell whose class score is the maximum of its 3x3 neighbourhood;
    the K best over all classes and cells are kept. Rows past the last peak (score 0)
    are all zero, so padding does not depend on how TopK breaks ties.
    """
    heat_logits, size, offset = split_maps(maps, num_classes)
    heat = torch.sigmoid(heat_logits)  # [B, C, h, w]
    peaks = F.max_pool2d(heat, 3, stride=1, padding=1)
    heat = heat * (peaks == heat).to(heat.dtype)
    b, _, h, w = heat.shape
    scores, index = torch.topk(heat.reshape(b, -1), k)  # [B, K], sorted descending
    # Indices are never negative, so truncating division is floor division (and one
    # ONNX Div, where floor rounding would export as a dozen sign-fixing nodes).
    cls = torch.div(index, h * w, rounding_mode="trunc")
    cell = index - cls * (h * w)
    ys = torch.div(cell, w, rounding_mode="trunc")
    xs = cell - ys * w
    at = cell.unsqueeze(1).expand(b, 2, k)
    wh = torch.gather(size.reshape(b, 2, h * w), 2, at)  # [B, 2, K], cells
    off = torch.gather(offset.reshape(b, 2, h * w), 2, at)  # [B, 2, K], cells
    cx = (xs.to(heat.dtype) + off[:, 0]) * stride
    cy = (ys.to(heat.dtype) + off[:, 1]) * stride
    half_w = wh[:, 0].clamp_min(0.0) * (stride / 2)
    half_h = wh[:, 1].clamp_min(0.0) * (stride / 2)
    frame_h, frame_w = frame_size
    x1 = ((cx - half_w) / frame_w).clamp(0.0, 1.0)
    y1 = ((cy - half_h) / frame_h).clamp(0.0, 1.0)
    x2 = ((cx + half_w) / frame_w).clamp(0.0, 1.0)
    y2 = ((cy + half_h) / frame_h).clamp(0.0, 1.0)
    rows = torch.stack([x1, y1, x2, y2, scores, cls.to(heat.dtype)], dim=-1)  # [B, K, 6]
    return rows * (scores > 0).to(heat.dtype).unsqueeze(-1)


class FramesDetector(nn.Module):
    """The deployable form: uint8 [B, H, W, 3] RGB frames -> float [B, K, 6] detections."""

    def __init__(self, net: nn.Module, num_classes: int, k: int = MAX_DETECTIONS) -> None:
        super().__init__()
        self.net = net
        self.num_classes = num_classes
        self.k = k

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        # Transpose while still uint8, then cast and normalise; the Sub-then-Mul order
        # is the pattern the INT8 export folds into the camera byte.
        x = frames.permute(0, 3, 1, 2).to(torch.float32)  # [B, 3, H, W]
        x = (x - INPUT_ZERO_POINT) * INPUT_SCALE
        maps = self.net(x)
        return decode_detections(
            maps, self.num_classes, (int(frames.shape[1]), int(frames.shape[2])), k=self.k
        )


@torch.inference_mode()
def net_detections(
    net: nn.Module, frames: np.ndarray, num_classes: int, *, batch_size: int = 64
) -> np.ndarray:
    """float32 [N, K, 6] detections of a network on uint8 NHWC frames (eval mode)."""
    model = FramesDetector(net, num_classes)
    out = []
    with _eval_mode(net):
        for i in range(0, len(frames), batch_size):
            chunk = np.array(frames[i : i + batch_size], dtype=np.uint8)  # writable copy
            out.append(model(torch.from_numpy(chunk)).numpy())
    if not out:
        return np.zeros((0, MAX_DETECTIONS, 6), dtype=np.float32)
    return np.concatenate(out).astype(np.float32)


def detector_profile(net: nn.Module, frame_size: int) -> dict[str, Any]:
    """Parameters and per-frame multiply-accumulates, counted from every conv's shape.

    A conv's MACs are its output elements times ``in_channels / groups * kh * kw``
    (BN, ReLU, upsampling and the decode add well under 1%). FLOPs are 2 x MACs.
    """
    layers: list[dict[str, Any]] = []
    names = {m: n for n, m in net.named_modules()}

    def hook(mod: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        assert isinstance(mod, nn.Conv2d)
        kh, kw = mod.kernel_size
        macs = int(output[0].numel()) * (mod.in_channels // mod.groups) * kh * kw
        layers.append(
            {
                "layer": names[mod],
                "output": list(output.shape[1:]),
                "params": sum(p.numel() for p in mod.parameters()),
                "macs": macs,
            }
        )

    handles = [m.register_forward_hook(hook) for m in net.modules() if isinstance(m, nn.Conv2d)]
    try:
        with _eval_mode(net), torch.inference_mode():
            net(torch.zeros(1, 3, frame_size, frame_size))
    finally:
        for handle in handles:
            handle.remove()
    macs = sum(layer["macs"] for layer in layers)
    return {
        "params": sum(p.numel() for p in net.parameters()),
        "macs": macs,
        "flops": 2 * macs,
        "frame_size": frame_size,
        "layers": layers,
    }


@dataclass(frozen=True)
class DetectorMeta:
    """What a detector checkpoint needs to rebuild and describe its network."""

    arch: str
    class_names: tuple[str, ...]
    frame_size: int
    width: float = 1.0
    name: str = "edgeloop-detector"
    version: str = "0"
    train_config: Mapping[str, Any] = field(default_factory=dict)

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["class_names"] = list(self.class_names)
        d["train_config"] = dict(self.train_config)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> DetectorMeta:
        return cls(
            arch=str(d["arch"]),
            class_names=tuple(str(c) for c in d["class_names"]),
            frame_size=int(d["frame_size"]),
            width=float(d.get("width", 1.0)),
            name=str(d.get("name", "edgeloop-detector")),
            version=str(d.get("version", "0")),
            train_config=dict(d.get("train_config", {})),
        )


@dataclass(frozen=True)
class LoadedDetector:
    net: nn.Module  # in eval mode
    meta: DetectorMeta


def save_detector(path: Path, net: nn.Module, meta: DetectorMeta) -> None:
    """Write ``{format, meta, state_dict}`` atomically; loadable with ``weights_only=True``."""
    payload = {
        "format": _CHECKPOINT_FORMAT,
        "format_version": _CHECKPOINT_VERSION,
        "meta": meta.to_dict(),
        "state_dict": {k: v.detach().cpu() for k, v in net.state_dict().items()},
    }
    with atomic_path(Path(path)) as tmp:
        torch.save(payload, tmp)


def load_detector(path: Path) -> LoadedDetector:
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"no detector checkpoint at {path}")
    try:
        # weights_only: a checkpoint from elsewhere must not be able to run code.
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ModelError(f"cannot read detector checkpoint {path}: {exc}") from exc
    if not isinstance(payload, dict) or payload.get("format") != _CHECKPOINT_FORMAT:
        raise ModelError(f"{path} is not an EdgeLoop detector checkpoint")
    if int(payload.get("format_version", 0)) > _CHECKPOINT_VERSION:
        raise ModelError(
            f"{path} has detector format {payload['format_version']};"
            f" this EdgeLoop reads up to {_CHECKPOINT_VERSION}"
        )
    try:
        meta = DetectorMeta.from_dict(payload["meta"])
        net = build_detector(meta.arch, meta.num_classes, meta.width)
        net.load_state_dict(payload["state_dict"])
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(f"checkpoint {path} does not match its architecture: {exc}") from exc
    return LoadedDetector(net=net.eval(), meta=meta)


@contextlib.contextmanager
def _eval_mode(net: nn.Module) -> Iterator[nn.Module]:
    was_training = net.training
    net.eval()
    try:
        yield net
    finally:
        net.train(was_training)
