"""The teacher and the edge student (PyTorch), their deployable wrapper, profile and checkpoints.

Both networks take float NCHW input normalised as ``(pixel - 128) / 64``.
``FramesModel`` wraps either one into the deployable contract: uint8 NHWC RGB
frames in, class probabilities out. That wrapper is what ONNX export traces and
what the PyTorch-eager benchmark runs.

The normalisation is one scalar offset and scale rather than per-channel ImageNet
statistics on purpose: with an offset of exactly 128 and a scale of 1/64, a uint8
pixel *is* the quantized form of the normalised input (zero point 128, scale 1/64),
so the INT8 student can feed camera bytes straight into its first quantized conv
(see ``distill.quantize``).

Student design: a patchify stem (8x8 conv, stride 8) followed by pointwise-heavy
layers. ONNX Runtime's INT8 kernels run 1x1 and strided 3x3 convolutions close to
peak, while a full-resolution stem with 3 input channels is slow in INT8 (K = 27) and
would eat most of the quantization gain. The 8x8 scans are coarse enough that
an 8 px patch grid loses little.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from distill._io import atomic_path
from shared.errors import ModelError

__all__ = [
    "ARCHITECTURES",
    "INPUT_SCALE",
    "INPUT_ZERO_POINT",
    "Arch",
    "ConvBNReLU",
    "FramesModel",
    "LoadedModel",
    "ModelMeta",
    "StudentNet",
    "TeacherNet",
    "build_model",
    "frames_to_input",
    "fuse_conv_bn",
    "load_checkpoint",
    "model_profile",
    "save_checkpoint",
    "torch_threads",
    "transfer_weights",
]

INPUT_ZERO_POINT = 128.0
INPUT_SCALE = 1.0 / 64.0

Arch = Literal["teacher-cnn", "student-cnn"]
ARCHITECTURES: tuple[Arch, ...] = ("teacher-cnn", "student-cnn")
_CHECKPOINT_FORMAT = "edgeloop-checkpoint"
_CHECKPOINT_VERSION = 1


class ConvBNReLU(nn.Sequential):
    """Conv (no bias) -> BatchNorm -> ReLU; the BN folds into the conv for export."""

    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1) -> None:
        padding = kernel // 2 if kernel % 2 else 0
        super().__init__(
            nn.Conv2d(cin, cout, kernel, stride, padding, bias=False),
            nn.BatchNorm2d(cout),
            nn.ReLU(inplace=True),
        )


def _ch(base: int, width: float) -> int:
    # Multiples of 8 keep the INT8 and SIMD kernels on their fast paths.
    return max(8, round(base * width / 8) * 8)


class TeacherNet(nn.Module):
    """A VGG-style CNN: seven 3x3 conv blocks, 64x64 -> 4x4, global pool, dropout, linear."""

    def __init__(self, num_classes: int, width: float = 1.0) -> None:
        super().__init__()
        c1, c2, c3, c4 = (_ch(b, width) for b in (32, 64, 128, 256))
        self.features = nn.Sequential(
            ConvBNReLU(3, c1, 3, 2),  # [B, c1, H/2, W/2]
            ConvBNReLU(c1, c2, 3, 2),  # [B, c2, H/4, W/4]
            ConvBNReLU(c2, c2, 3),
            ConvBNReLU(c2, c3, 3, 2),  # [B, c3, H/8, W/8]
            ConvBNReLU(c3, c3, 3),
            ConvBNReLU(c3, c4, 3, 2),  # [B, c4, H/16, W/16]
            ConvBNReLU(c4, c4, 3),
        )
        self.head = nn.Sequential(
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Dropout(0.2), nn.Linear(c4, num_classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))  # [B, num_classes] logits


class StudentNet(nn.Module):
    """Edge student: 8x8/8 patchify stem, 1x1 -> strided 3x3 -> 1x1, global pool, linear."""

    def __init__(self, num_classes: int, width: float = 1.0) -> None:
        super().__init__()
        c1, c2, c3 = (_ch(b, width) for b in (64, 128, 256))
        self.features = nn.Sequential(
            ConvBNReLU(3, c1, 8, 8),  # [B, c1, H/8, W/8]
            ConvBNReLU(c1, c2, 1),
            ConvBNReLU(c2, c2, 3, 2),  # [B, c2, H/16, W/16]
            ConvBNReLU(c2, c3, 1),
        )
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c3, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))  # [B, num_classes] logits


def build_model(arch: str, num_classes: int, width: float = 1.0) -> nn.Module:
    if num_classes < 2:
        raise ModelError(f"a classifier needs at least 2 classes, got {num_classes}")
    if width <= 0:
        raise ModelError(f"width must be > 0, got {width}")
    if arch == "teacher-cnn":
        return TeacherNet(num_classes, width)
    if arch == "student-cnn":
        return StudentNet(num_classes, width)
    raise ModelError(f"unknown architecture {arch!r}; expected one of {', '.join(ARCHITECTURES)}")


def frames_to_input(frames: np.ndarray | torch.Tensor) -> torch.Tensor:
    """uint8 NHWC frames -> float32 NCHW network input, normalised as in the exported graph."""
    if isinstance(frames, np.ndarray):
        # Read-only arrays (cached renders) must be copied: torch wants writable memory.
        arr = frames if frames.flags.writeable else frames.copy()
        t = torch.from_numpy(np.ascontiguousarray(arr))
    else:
        t = frames
    return (t.permute(0, 3, 1, 2).to(torch.float32) - INPUT_ZERO_POINT) * INPUT_SCALE


class FramesModel(nn.Module):
    """The deployable form: uint8 [B, H, W, 3] RGB frames -> float [B, classes] probabilities."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, frames: torch.Tensor) -> torch.Tensor:
        # Transpose while still uint8 (a quarter of the bytes), then cast and
        # normalise; the order (Sub then Mul) is the pattern distill.quantize folds.
        x = frames.permute(0, 3, 1, 2).to(torch.float32)  # [B, 3, H, W]
        x = (x - INPUT_ZERO_POINT) * INPUT_SCALE
        return F.softmax(self.net(x), dim=1)


def fuse_conv_bn(model: nn.Module) -> nn.Module:
    """A copy in eval mode with every Conv2d directly followed by BatchNorm2d folded into it."""
    fused = copy.deepcopy(model).eval()

    def visit(module: nn.Module) -> None:
        if isinstance(module, nn.Sequential):
            children = list(module)
            for i in range(len(children) - 1):
                conv, bn = children[i], children[i + 1]
                if isinstance(conv, nn.Conv2d) and isinstance(bn, nn.BatchNorm2d):
                    module[i] = torch.nn.utils.fusion.fuse_conv_bn_eval(conv, bn)
                    module[i + 1] = nn.Identity()
        for child in module.children():
            visit(child)

    visit(fused)
    return fused


def model_profile(model: nn.Module, frame_size: int) -> dict[str, Any]:
    """Parameters and per-frame multiply-accumulates of a network on one frame.

    MACs count Conv2d and Linear layers (what dominates; BN, ReLU and pooling add
    well under 1%); FLOPs are reported as 2 x MACs. Measured with forward hooks on
    a single [1, 3, frame_size, frame_size] input.
    """
    net = model.net if isinstance(model, FramesModel) else model
    layers: list[dict[str, Any]] = []

    def hook(mod: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
        if isinstance(mod, nn.Conv2d):
            kh, kw = mod.kernel_size
            per_out = (mod.in_channels // mod.groups) * kh * kw
            macs = int(output[0].numel()) * per_out
        elif isinstance(mod, nn.Linear):
            macs = mod.in_features * mod.out_features
        else:
            return
        layers.append(
            {
                "layer": names[mod],
                "type": type(mod).__name__,
                "output": list(output.shape[1:]),
                "params": sum(p.numel() for p in mod.parameters()),
                "macs": macs,
            }
        )

    names = {m: n for n, m in net.named_modules()}
    handles = [
        m.register_forward_hook(hook) for m in net.modules() if isinstance(m, nn.Conv2d | nn.Linear)
    ]
    was_training = net.training
    try:
        net.eval()
        with torch.inference_mode():
            net(torch.zeros(1, 3, frame_size, frame_size))
    finally:
        net.train(was_training)
        for h in handles:
            h.remove()
    macs = sum(layer["macs"] for layer in layers)
    return {
        "params": sum(p.numel() for p in net.parameters()),
        "macs": macs,
        "flops": 2 * macs,
        "frame_size": frame_size,
        "layers": layers,
    }


@dataclass(frozen=True)
class ModelMeta:
    """What a checkpoint needs to rebuild and describe its model."""

    arch: str
    num_classes: int
    class_names: tuple[str, ...]
    frame_size: int
    width: float = 1.0
    name: str = "edgeloop-model"
    version: str = "0"
    train_config: Mapping[str, Any] = field(default_factory=dict)
    metrics: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["class_names"] = list(self.class_names)
        d["train_config"] = dict(self.train_config)
        d["metrics"] = dict(self.metrics)
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ModelMeta:
        return cls(
            arch=str(d["arch"]),
            num_classes=int(d["num_classes"]),
            class_names=tuple(str(c) for c in d["class_names"]),
            frame_size=int(d["frame_size"]),
            width=float(d.get("width", 1.0)),
            name=str(d.get("name", "edgeloop-model")),
            version=str(d.get("version", "0")),
            train_config=dict(d.get("train_config", {})),
            metrics=dict(d.get("metrics", {})),
        )


@dataclass(frozen=True)
class LoadedModel:
    net: nn.Module  # in eval mode
    meta: ModelMeta


def save_checkpoint(path: Path, net: nn.Module, meta: ModelMeta) -> None:
    """Write ``{format, meta, state_dict}`` atomically; loadable with ``weights_only=True``."""
    payload = {
        "format": _CHECKPOINT_FORMAT,
        "format_version": _CHECKPOINT_VERSION,
        "meta": meta.to_dict(),
        "state_dict": {k: v.detach().cpu() for k, v in net.state_dict().items()},
    }
    with atomic_path(Path(path)) as tmp:
        torch.save(payload, tmp)


def load_checkpoint(path: Path) -> LoadedModel:
    path = Path(path)
    if not path.is_file():
        raise ModelError(f"no checkpoint at {path}")
    try:
        # weights_only: a checkpoint from elsewhere must not be able to run code.
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise ModelError(f"cannot read checkpoint {path}: {exc}") from exc
    if not isinstance(payload, dict) or payload.get("format") != _CHECKPOINT_FORMAT:
        raise ModelError(f"{path} is not an EdgeLoop checkpoint")
    if int(payload.get("format_version", 0)) > _CHECKPOINT_VERSION:
        raise ModelError(
            f"{path} has checkpoint format {payload['format_version']};"
            f" this EdgeLoop reads up to {_CHECKPOINT_VERSION}"
        )
    try:
        meta = ModelMeta.from_dict(payload["meta"])
        net = build_model(meta.arch, meta.num_classes, meta.width)
        net.load_state_dict(payload["state_dict"])
    except ModelError:
        raise
    except Exception as exc:
        raise ModelError(f"checkpoint {path} does not match its architecture: {exc}") from exc
    return LoadedModel(net=net.eval(), meta=meta)


def transfer_weights(net: nn.Module, state: Mapping[str, torch.Tensor]) -> list[str]:
    """Copy into ``net`` every tensor of ``state`` whose name and shape match; the names of
    ``net``'s tensors left as they were (a classifier head of another size, for one).

    A warm start from a student of another class set keeps its features and gives the
    head its fresh initialisation, instead of failing on a [3, 256] vs [10, 256] weight.
    """
    own = net.state_dict()
    kept = {k: v for k, v in state.items() if k in own and tuple(own[k].shape) == tuple(v.shape)}
    net.load_state_dict({**own, **kept})
    return [k for k in own if k not in kept]


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run a block with torch's intra-op thread count set to ``n``, then restore it."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
