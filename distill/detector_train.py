"""Detector training, read top to bottom: labels, targets, loss, then the loop. One
``DetTrainConfig`` holds every knob.

Labels are boxes per frame (``FrameBoxes``: pixel xyxy, class, score). Ground truth
comes from a ``DetectionSet`` (score 1, ``labels_from_set``); a teacher's pseudo-labels
from its ``detections`` rows (``pseudo_labels``); ``merge_labels`` takes a human label
where a frame has one and the teacher's otherwise. The same ``train_detector`` thus
trains the teacher from ground truth and the student from teacher plus human labels.
A box scoring at least ``min_score`` is an object; one scoring between
``ignore_score`` and ``min_score`` is a region the loss ignores (the teacher was unsure:
neither a positive nor a background to be pushed down).

Targets (CenterNet, with TTFNet's elliptical Gaussians): each object puts a Gaussian
of its box's shape (sigma = 0.54 x side / 6) on its class heatmap, peaking at exactly 1
on the cell holding its centre; that cell also carries the box's size in cells and
the centre's offset within the cell. The loss is the penalty-reduced focal loss on
the heatmap, normalised by the number of objects, plus L1 on size and offset at the
centre cells.

Augmentation is modest on purpose: no flips (a mirrored digit is another digit or
none), a small scale jitter per batch, and training crops (a fully convolutional
network learns the same from a crop of a frame at a fraction of the cost; objects cut
by a crop's edge are ignored rather than taught half). A teacher meant to stay right
when the line drifts also sees drifted views of its frames (``drift_views``): the
same scenes under random mixes of the named drifts, boxes moved with the objects.

``replay_share`` of every epoch is drawn from a second, reference set of frames and
labels (replay against forgetting, when a student is fine-tuned on new frames).

Determinism: given the seed, initialisation, data order, replay picks, scale and crops
are fixed; torch's CPU kernels are deterministic at a fixed thread count.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from torch import nn

from distill.detectors import OUTPUT_STRIDE, build_detector, net_detections, split_maps
from distill.models import frames_to_input, torch_threads
from distill.scenes import DetectionSet
from shared.errors import DataError, ModelError
from shared.tasks.detection import average_precision

__all__ = [
    "DetTrainConfig",
    "DetTrainResult",
    "FrameBoxes",
    "Targets",
    "build_targets",
    "detection_loss",
    "labels_from_set",
    "merge_labels",
    "pseudo_labels",
    "set_map50",
    "train_detector",
]

_SIGMA_ALPHA = 0.54  # TTFNet: Gaussian sigma = alpha * box side / 6
_KEEP_IN_CROP = 0.8  # least share of a box inside a crop for it to stay an object


@dataclass(frozen=True)
class DetTrainConfig:
    """Every knob of a detector training run. All fields except ``threads`` go into cache keys."""

    role: Literal["teacher", "student"] = "student"
    arch: str = ""  # "" picks the role's architecture
    width: float = 1.0
    epochs: int = 10
    batch_size: int = 32
    lr: float = 4e-3
    weight_decay: float = 1e-4
    seed: int = 0
    frame_size: int = 320
    crop: int = 160  # training crop side (a multiple of 8); 0 trains on whole frames
    scale_jitter: float = 0.1  # each batch is resized by a factor in 1 +- this
    min_score: float = 0.3  # labels below it are not objects
    ignore_score: float = 0.1  # labels in [ignore_score, min_score) are ignored regions
    replay_share: float = 0.0  # share of each epoch drawn from the replay set
    # Drifted renderings of the training frames (built by the caller, which holds the
    # scenes: ``distill.scene_drift.random_scene_drifts``); each epoch shows every frame
    # clean with probability ``p_clean``, else one of its drifted views at random.
    drift_views: int = 0
    p_clean: float = 0.3
    size_weight: float = 0.2
    offset_weight: float = 1.0
    # One intra-op thread by default: where the cores are shared with other work,
    # OpenMP's barriers make two threads many times slower than one.
    threads: int = 1
    eval_every: int = 0  # score val_set every this many epochs too (0: after the last only)

    def __post_init__(self) -> None:
        if self.role not in ("teacher", "student"):
            raise ModelError(f"role must be 'teacher' or 'student', got {self.role!r}")
        if not self.arch:
            object.__setattr__(self, "arch", f"{self.role}-det")
        for name in ("epochs", "batch_size", "frame_size", "threads"):
            if getattr(self, name) < 1:
                raise ModelError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.frame_size % OUTPUT_STRIDE or self.crop % OUTPUT_STRIDE:
            raise ModelError(f"frame_size and crop must be multiples of {OUTPUT_STRIDE}")
        if self.crop and self.crop > self.frame_size * (1 - self.scale_jitter):
            raise ModelError("crop must fit in the smallest jittered frame")
        if self.lr <= 0 or not 0.0 <= self.scale_jitter < 0.5:
            raise ModelError("lr must be > 0 and scale_jitter in [0, 0.5)")
        if not 0.0 <= self.ignore_score <= self.min_score <= 1.0:
            raise ModelError("need 0 <= ignore_score <= min_score <= 1")
        if not 0.0 <= self.replay_share < 1.0:
            raise ModelError(f"replay_share must be in [0, 1), got {self.replay_share}")
        if self.drift_views < 0 or not 0.0 <= self.p_clean <= 1.0:
            raise ModelError("drift_views must be >= 0 and p_clean in [0, 1]")

    def with_(self, **overrides: Any) -> DetTrainConfig:
        return replace(self, **overrides)

    def cache_fields(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("threads")
        d.pop("eval_every")
        if not self.drift_views:  # keys of runs without drifted views stay as they were
            d.pop("drift_views")
            d.pop("p_clean")
        return d


@dataclass
class DetTrainResult:
    net: nn.Module  # the last epoch's weights (one-cycle annealed), eval mode
    config: DetTrainConfig
    metrics: dict[str, Any]
    history: list[dict[str, float]] = field(default_factory=list)


# ---------------------------------------------------------------------------------
# Labels


@dataclass(frozen=True)
class FrameBoxes:
    """One frame's labels: float32 [k, 4] pixel xyxy, int64 [k] classes, float32 [k] scores."""

    boxes: np.ndarray
    classes: np.ndarray
    scores: np.ndarray

    @classmethod
    def of(
        cls, boxes: np.ndarray, classes: np.ndarray, scores: np.ndarray | None = None
    ) -> FrameBoxes:
        b = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
        c = np.asarray(classes, dtype=np.int64).reshape(-1)
        s = np.ones(len(b), np.float32) if scores is None else np.asarray(scores, np.float32)
        if len(c) != len(b) or s.shape != (len(b),):
            raise DataError(f"{len(b)} boxes need as many classes and scores")
        return cls(b, c, s.reshape(-1))


def labels_from_set(ds: DetectionSet) -> list[FrameBoxes]:
    """Ground truth as labels (every score 1)."""
    return [FrameBoxes.of(b, c) for b, c in zip(ds.boxes, ds.classes, strict=True)]


def pseudo_labels(detections: np.ndarray, frame_size: int) -> list[FrameBoxes]:
    """A detector's ``[N, K, 6]`` rows (fractional corners) as pixel labels with scores."""
    d = np.asarray(detections, dtype=np.float32)
    if d.ndim != 3 or d.shape[2] != 6:
        raise DataError(f"expected [N, K, 6] detections, got {d.shape}")
    out = []
    for rows in d:
        rows = rows[rows[:, 4] > 0]
        out.append(FrameBoxes.of(rows[:, :4] * frame_size, rows[:, 5].astype(np.int64), rows[:, 4]))
    return out


def merge_labels(
    human: Sequence[FrameBoxes | None], teacher: Sequence[FrameBoxes | None]
) -> list[FrameBoxes]:
    """Per frame, the human label where there is one, else the teacher's (else none)."""
    if len(human) != len(teacher):
        raise DataError(f"{len(human)} human labels for {len(teacher)} teacher labels")
    empty = FrameBoxes.of(np.zeros((0, 4)), np.zeros(0))
    return [
        h if h is not None else (t if t is not None else empty)
        for h, t in zip(human, teacher, strict=True)
    ]


# ---------------------------------------------------------------------------------
# Targets and loss


@dataclass(frozen=True)
class Targets:
    """Training targets at output stride for a batch of B frames, C classes, h x w cells."""

    heat: torch.Tensor  # [B, C, h, w], 1 exactly at object centres
    size: torch.Tensor  # [B, 2, h, w], box (w, h) in cells at centres
    offset: torch.Tensor  # [B, 2, h, w], centre offset within its cell
    centres: torch.Tensor  # [B, h, w], 1 at object centres
    weight: torch.Tensor  # [B, h, w], 0 in ignored regions, else 1


def build_targets(
    labels: Sequence[FrameBoxes],
    ignore: Sequence[np.ndarray],
    out_hw: tuple[int, int],
    num_classes: int,
    stride: int = OUTPUT_STRIDE,
) -> Targets:
    """Targets for boxes given in input pixels (``labels`` objects, ``ignore`` [m, 4] boxes)."""
    h, w = out_hw
    b = len(labels)
    heat = np.zeros((b, num_classes, h, w), np.float32)
    size = np.zeros((b, 2, h, w), np.float32)
    offset = np.zeros((b, 2, h, w), np.float32)
    centres = np.zeros((b, h, w), np.float32)
    weight = np.ones((b, h, w), np.float32)
    ys, xs = np.arange(h, dtype=np.float32), np.arange(w, dtype=np.float32)
    for i, (lab, ign) in enumerate(zip(labels, ignore, strict=True)):
        for x1, y1, x2, y2 in np.asarray(ign, np.float32).reshape(-1, 4) / stride:
            weight[i, int(y1) : int(np.ceil(y2)), int(x1) : int(np.ceil(x2))] = 0.0
        for (x1, y1, x2, y2), c in zip(lab.boxes / stride, lab.classes, strict=True):
            bw, bh = x2 - x1, y2 - y1
            if bw <= 0 or bh <= 0:
                continue
            cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
            ix, iy = min(int(cx), w - 1), min(int(cy), h - 1)
            sx, sy = max(_SIGMA_ALPHA * bw / 6, 0.1), max(_SIGMA_ALPHA * bh / 6, 0.1)
            gx = np.exp(-((xs - ix) ** 2) / (2 * sx * sx))
            gy = np.exp(-((ys - iy) ** 2) / (2 * sy * sy))
            np.maximum(heat[i, c], gy[:, None] * gx[None, :], out=heat[i, c])
            size[i, :, iy, ix] = (bw, bh)
            offset[i, :, iy, ix] = (cx - ix, cy - iy)
            centres[i, iy, ix] = 1.0
    # An object's own Gaussian always counts, even inside an ignored region.
    weight = np.maximum(weight, (heat.max(axis=1) > 0).astype(np.float32))
    return Targets(
        heat=torch.from_numpy(heat),
        size=torch.from_numpy(size),
        offset=torch.from_numpy(offset),
        centres=torch.from_numpy(centres),
        weight=torch.from_numpy(weight),
    )


def detection_loss(
    maps: torch.Tensor,
    targets: Targets,
    num_classes: int,
    *,
    size_weight: float,
    offset_weight: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Penalty-reduced focal loss on the heatmap + L1 on size and offset at centres."""
    logits, size, offset = split_maps(maps, num_classes)
    gt = targets.heat
    pos = (gt >= 1.0).to(logits.dtype)
    p = torch.sigmoid(logits)
    log_p, log_not_p = F.logsigmoid(logits), F.logsigmoid(-logits)
    pos_loss = (log_p * (1 - p) ** 2 * pos).sum()
    neg_w = (1 - gt) ** 4 * (1 - pos) * targets.weight.unsqueeze(1)
    neg_loss = (log_not_p * p**2 * neg_w).sum()
    n = targets.centres.sum().clamp_min(1.0)
    heat = -(pos_loss + neg_loss) / n
    mask = targets.centres.unsqueeze(1)
    size_l1 = (torch.abs(size - targets.size) * mask).sum() / n
    offset_l1 = (torch.abs(offset - targets.offset) * mask).sum() / n
    total = heat + size_weight * size_l1 + offset_weight * offset_l1
    return total, {"heat": heat.item(), "size": size_l1.item(), "offset": offset_l1.item()}


# ---------------------------------------------------------------------------------
# Batches: replay mix, scale jitter, crops


def _split_label(lab: FrameBoxes, cfg: DetTrainConfig) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(object boxes, their classes, ignored boxes) of one frame's labels."""
    obj = lab.scores >= cfg.min_score
    unsure = (lab.scores >= cfg.ignore_score) & ~obj
    return lab.boxes[obj], lab.classes[obj], lab.boxes[unsure]


def _epoch_order(
    n_main: int, n_replay: int, cfg: DetTrainConfig, epoch: int
) -> list[tuple[int, int]]:
    """(source, index) pairs of one epoch: every main frame plus the replay share, shuffled."""
    rng = np.random.default_rng([cfg.seed, epoch])
    items = [(0, i) for i in range(n_main)]
    if n_replay and cfg.replay_share > 0:
        want = round(n_main * cfg.replay_share / (1 - cfg.replay_share))
        picks = rng.choice(n_replay, size=want, replace=want > n_replay)
        items += [(1, int(i)) for i in picks]
    order = rng.permutation(len(items))
    return [items[j] for j in order]


def _view_choice(n_main: int, n_views: int, cfg: DetTrainConfig, epoch: int) -> np.ndarray:
    """Per main frame of one epoch: -1 (show it clean) or the drifted view to show."""
    if not n_views:
        return np.full(n_main, -1, np.int64)
    rng = np.random.default_rng([cfg.seed, epoch, 7])
    clean = rng.uniform(size=n_main) < cfg.p_clean
    return np.where(clean, -1, rng.integers(0, n_views, size=n_main))


def _moved(
    lab: FrameBoxes, cfg: DetTrainConfig, corner: tuple[int, int], factor: float, side: int
) -> tuple[FrameBoxes, np.ndarray]:
    """One frame's objects and ignored boxes in a crop at ``corner`` resized by ``factor``."""
    boxes, classes, ignored = _split_label(lab, cfg)
    shift = np.array([*corner, *corner], np.float32)
    boxes, ignored = (boxes - shift) * factor, (ignored - shift) * factor
    clipped = np.clip(boxes, 0, side)
    area = np.maximum((boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1]), 1e-6)
    inside = (clipped[:, 2] - clipped[:, 0]).clip(0) * (clipped[:, 3] - clipped[:, 1]).clip(0)
    keep = inside / area >= _KEEP_IN_CROP
    cut = ~keep & (inside > 0)
    ignore = np.concatenate([np.clip(ignored, 0, side), clipped[cut]])
    return FrameBoxes.of(clipped[keep], classes[keep]), ignore


def _augment(
    frames: np.ndarray,
    labels: Sequence[FrameBoxes],
    cfg: DetTrainConfig,
    rng: np.random.Generator,
) -> tuple[torch.Tensor, list[FrameBoxes], list[np.ndarray]]:
    """Normalised, scale-jittered (cropped) input [B, 3, s, s] with labels moved to match.

    With crops, each frame gets its own scale: a source square of ``crop / scale``
    pixels is cut (from the uint8 frame, before any float work) and resized to
    ``crop``. Whole frames share one scale per batch, rounded to the output stride.
    """
    n, size = len(frames), frames.shape[1]
    j = cfg.scale_jitter
    if not cfg.crop:
        scale = float(rng.uniform(1 - j, 1 + j))
        new = max(OUTPUT_STRIDE, round(size * scale / OUTPUT_STRIDE) * OUTPUT_STRIDE)
        x = frames_to_input(frames)  # [B, 3, S, S]
        if new != size:
            x = F.interpolate(x, size=(new, new), mode="bilinear", align_corners=False)
        moved = [_moved(lab, cfg, (0, 0), new / size, new) for lab in labels]
        return x, [m[0] for m in moved], [m[1] for m in moved]
    crop = cfg.crop
    scales = rng.uniform(1 - j, 1 + j, size=n)
    patches, out_labels, out_ignore = [], [], []
    for i, lab in enumerate(labels):
        src = min(size, round(crop / float(scales[i])))
        ox, oy = (int(v) for v in rng.integers(0, size - src + 1, size=2))
        patch = frames_to_input(frames[i : i + 1, oy : oy + src, ox : ox + src])
        if src != crop:
            patch = F.interpolate(patch, size=(crop, crop), mode="bilinear", align_corners=False)
        patches.append(patch[0])  # [3, crop, crop]
        boxes, ignore = _moved(lab, cfg, (ox, oy), crop / src, crop)
        out_labels.append(boxes)
        out_ignore.append(ignore)
    return torch.stack(patches), out_labels, out_ignore


def set_map50(net: nn.Module, ds: DetectionSet, num_classes: int) -> float:
    """mAP@0.5 of a network on a set (numpy reference computation, no pycocotools)."""
    rows = net_detections(net, ds.frames, num_classes)
    size = ds.frame_size
    truth = [
        [(*(b / size).tolist(), 1.0, int(c)) for b, c in zip(bs, cs, strict=True)]
        for bs, cs in zip(ds.boxes, ds.classes, strict=True)
    ]
    predicted = [[tuple(r) for r in frame if r[4] > 0] for frame in rows.tolist()]
    return average_precision(predicted, truth)


def _progress(enabled: bool, console: Console | None) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        console=console or Console(stderr=True),
        disable=not enabled,
    )


# ---------------------------------------------------------------------------------
# The run


def train_detector(
    config: DetTrainConfig,
    frames: np.ndarray,
    labels: Sequence[FrameBoxes],
    *,
    class_names: Sequence[str],
    val_set: DetectionSet | None = None,
    replay: tuple[np.ndarray, Sequence[FrameBoxes]] | None = None,
    views: Sequence[tuple[np.ndarray, Sequence[FrameBoxes]]] = (),
    init: nn.Module | Mapping[str, torch.Tensor] | None = None,
    progress: bool = False,
    console: Console | None = None,
    on_epoch: Callable[[dict[str, float]], None] | None = None,
) -> DetTrainResult:
    """Train one detector on uint8 NHWC ``frames`` with one ``FrameBoxes`` each.

    ``replay`` (frames, labels) supplies ``config.replay_share`` of every epoch;
    ``views`` are ``config.drift_views`` drifted renderings (frames, labels) of the
    training frames, one picked per frame and epoch unless it is shown clean;
    ``init`` warm-starts from a network of the same architecture (or its state dict);
    ``val_set`` is scored (mAP@0.5) after the last epoch (and every ``eval_every``);
    ``on_epoch(record)`` receives each epoch's losses (and score) as it ends.
    """
    started = time.perf_counter()
    cfg = config
    num_classes = len(class_names)

    # -- data --------------------------------------------------------------------
    if len(frames) == 0 or len(frames) != len(labels):
        raise DataError(
            f"need one label per frame and at least one frame: {len(frames)} frames,"
            f" {len(labels)} labels"
        )
    if frames.dtype != np.uint8 or frames.shape[1:] != (cfg.frame_size, cfg.frame_size, 3):
        raise DataError(
            f"frames must be uint8 [N, {cfg.frame_size}, {cfg.frame_size}, 3],"
            f" got {frames.dtype} {frames.shape}"
        )
    sources: list[tuple[np.ndarray, Sequence[FrameBoxes]]] = [(frames, labels)]
    if replay is not None:
        if len(replay[0]) != len(replay[1]) or replay[0].shape[1:] != frames.shape[1:]:
            raise DataError("replay frames must match the training frames and have one label each")
        sources.append(replay)
    n_replay = len(replay[0]) if replay is not None else 0
    if len(views) != cfg.drift_views:
        raise DataError(f"the config asks for {cfg.drift_views} drifted views, got {len(views)}")
    for view_frames, view_labels in views:
        if view_frames.shape != frames.shape or len(view_labels) != len(labels):
            raise DataError("each drifted view needs the training frames' shape and one label each")
    objects = sum(int((lab.scores >= cfg.min_score).sum()) for lab in labels)

    # -- model -------------------------------------------------------------------
    torch.manual_seed(cfg.seed)
    net = build_detector(cfg.arch, num_classes, cfg.width)
    if init is not None:
        state = init.state_dict() if isinstance(init, nn.Module) else dict(init)
        try:
            net.load_state_dict(state)
        except RuntimeError as exc:
            raise ModelError(f"cannot warm-start {cfg.arch} from the given weights: {exc}") from exc
    # channels_last: oneDNN's CPU convolutions train faster in NHWC memory order.
    net = net.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    optimizer = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    per_epoch = len(_epoch_order(len(frames), n_replay, cfg, 0))
    steps_per_epoch = (per_epoch + cfg.batch_size - 1) // cfg.batch_size
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=cfg.lr, total_steps=cfg.epochs * steps_per_epoch, pct_start=0.15
    )
    history: list[dict[str, float]] = []

    # -- loop --------------------------------------------------------------------
    with torch_threads(cfg.threads), _progress(progress, console) as bar:
        task = bar.add_task(f"train {cfg.role}", total=cfg.epochs * steps_per_epoch, status="")
        for epoch in range(1, cfg.epochs + 1):
            net.train()
            order = _epoch_order(len(frames), n_replay, cfg, epoch)
            view_of = _view_choice(len(frames), len(views), cfg, epoch)
            sums = {"loss": 0.0, "heat": 0.0, "size": 0.0, "offset": 0.0}
            steps = 0
            for step, start in enumerate(range(0, len(order), cfg.batch_size)):
                picks = order[start : start + cfg.batch_size]
                shown = [
                    views[view_of[i]] if s == 0 and view_of[i] >= 0 else sources[s]
                    for s, i in picks
                ]
                batch = np.stack([src[0][i] for src, (_, i) in zip(shown, picks, strict=True)])
                batch_labels = [src[1][i] for src, (_, i) in zip(shown, picks, strict=True)]
                rng = np.random.default_rng([cfg.seed, epoch, step])
                x, boxes, ignored = _augment(batch, batch_labels, cfg, rng)  # [B, 3, s, s]
                x = x.contiguous(memory_format=torch.channels_last)
                hw = (x.shape[2] // OUTPUT_STRIDE, x.shape[3] // OUTPUT_STRIDE)
                targets = build_targets(boxes, ignored, hw, num_classes)

                maps = net(x)  # [B, C + 4, h, w]
                loss, parts = detection_loss(
                    maps,
                    targets,
                    num_classes,
                    size_weight=cfg.size_weight,
                    offset_weight=cfg.offset_weight,
                )
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scheduler.step()

                sums["loss"] += loss.item()
                for k, v in parts.items():
                    sums[k] += v
                steps += 1
                bar.update(task, advance=1, status=f"epoch {epoch} loss {sums['loss'] / steps:.3f}")
            record = {"epoch": float(epoch), **{k: v / max(steps, 1) for k, v in sums.items()}}
            if val_set is not None and cfg.eval_every and epoch % cfg.eval_every == 0:
                record["val_map50"] = set_map50(net, val_set, num_classes)
            history.append(record)
            if on_epoch is not None:
                on_epoch(record)
            bar.update(task, status=" ".join(f"{k} {v:.3f}" for k, v in record.items()))

    net = net.to(memory_format=torch.contiguous_format)
    net.eval()
    wall = time.perf_counter() - started
    metrics: dict[str, Any] = {
        "role": cfg.role,
        "arch": cfg.arch,
        "epochs": cfg.epochs,
        "train_frames": len(frames),
        "replay_frames": n_replay,
        "drift_views": len(views),
        "train_objects": objects,
        "train_wall_s": round(wall, 2),
        "final_loss": history[-1]["loss"],
    }
    if val_set is not None:
        with torch_threads(cfg.threads):
            metrics["val_map50"] = set_map50(net, val_set, num_classes)
    return DetTrainResult(net=net, config=cfg, metrics=metrics, history=history)
