"""Training, read top to bottom: data, model, then the loop (forward, loss, backward, step,
evaluate, checkpoint). One ``TrainConfig`` holds every knob.

The loss is cross-entropy on the hard label, or, when teacher scores are given,
Hinton distillation::

    loss = alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T)) + (1 - alpha) * CE(label)

Teacher scores are the probabilities the exported models emit. The softened
teacher distribution is recovered from them exactly, since
``softmax(z / T) = p^(1/T) / sum(p^(1/T))`` for ``p = softmax(z)``.

Determinism: given the seed, data order, augmentation and initialisation are fixed;
torch's CPU kernels are deterministic at a fixed thread count.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from torch import nn

from distill.drift import apply_drift_frame, random_drift_spec
from distill.frames import FrameSet
from distill.models import ModelMeta, build_model, frames_to_input, save_checkpoint, torch_threads
from distill.tasks import CLASSIFICATION_TRAINING, soften
from shared.errors import DataError, ModelError

__all__ = [
    "Augment",
    "Role",
    "TrainConfig",
    "TrainResult",
    "distillation_loss",
    "evaluate_net",
    "fit_temperature",
    "fold_temperature",
    "net_logits",
    "random_drifts",
    "random_shift",
    "soften",
    "train",
    "validation_nll",
]

Role = Literal["teacher", "student"]
Augment = Callable[[np.ndarray, np.random.Generator], np.ndarray]


@dataclass(frozen=True)
class TrainConfig:
    """Every knob of a training run. All fields except ``threads`` go into cache keys."""

    role: Role = "student"
    arch: str = ""  # "" picks the role's architecture
    width: float = 1.0
    epochs: int = 12
    batch_size: int = 128
    lr: float = 3e-3
    weight_decay: float = 5e-4
    label_smoothing: float = 0.0
    seed: int = 0
    frame_size: int = 64
    # Drift augmentation (the teacher's): each training frame gets a random mix of
    # drifts at random severities; ``p_clean`` of them stay clean.
    augment_drift: bool = False
    p_clean: float = 0.3
    # Distillation, used when teacher scores are passed to ``train``.
    temperature: float = 4.0
    alpha: float = 0.7
    threads: int = 2

    def __post_init__(self) -> None:
        if self.role not in ("teacher", "student"):
            raise ModelError(f"role must be 'teacher' or 'student', got {self.role!r}")
        if not self.arch:
            object.__setattr__(self, "arch", f"{self.role}-cnn")
        for name in ("epochs", "batch_size", "frame_size", "threads"):
            if getattr(self, name) < 1:
                raise ModelError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or self.temperature <= 0 or not 0.0 <= self.alpha <= 1.0:
            raise ModelError("lr and temperature must be > 0 and alpha in [0, 1]")

    @classmethod
    def for_role(cls, role: Role, **overrides: Any) -> TrainConfig:
        """The reference knobs for a role; the teacher trains longer, on drifted frames."""
        if role == "teacher":
            base = cls(role="teacher", epochs=16, lr=2e-3, augment_drift=True)
        else:
            base = cls(role="student", epochs=15, lr=3e-3)
        return replace(base, **overrides)

    def cache_fields(self) -> dict[str, Any]:
        d = asdict(self)
        d.pop("threads")
        return d


@dataclass
class TrainResult:
    net: nn.Module  # best weights by validation score, eval mode
    config: TrainConfig
    metrics: dict[str, Any]
    history: list[dict[str, float]] = field(default_factory=list)


# ---------------------------------------------------------------------------------
# Pieces the loop uses


def distillation_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    teacher_probs: torch.Tensor | None,
    *,
    temperature: float,
    alpha: float,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """The classification task's loss (``distill.tasks``)."""
    return CLASSIFICATION_TRAINING.loss(
        logits,
        labels,
        teacher_probs,
        temperature=temperature,
        alpha=alpha,
        label_smoothing=label_smoothing,
    )


@torch.inference_mode()
def evaluate_net(
    net: nn.Module, frames: np.ndarray, labels: np.ndarray, batch_size: int = 256
) -> float:
    """Top-1 accuracy of a network on uint8 NHWC frames."""
    was_training = net.training
    net.eval()
    correct = 0
    for i in range(0, len(frames), batch_size):
        logits = net(frames_to_input(frames[i : i + batch_size]))
        correct += int((logits.argmax(1).numpy() == labels[i : i + batch_size]).sum())
    net.train(was_training)
    return correct / max(1, len(frames))


@torch.inference_mode()
def net_logits(net: nn.Module, frames: np.ndarray, batch_size: int = 256) -> torch.Tensor:
    """Logits [N, classes] of a network on uint8 NHWC frames (eval mode)."""
    was_training = net.training
    net.eval()
    out = [
        net(frames_to_input(frames[i : i + batch_size])) for i in range(0, len(frames), batch_size)
    ]
    net.train(was_training)
    return torch.cat(out) if out else torch.zeros((0, 0))


def validation_nll(net: nn.Module, frames: np.ndarray, labels: np.ndarray) -> float:
    """Mean negative log-likelihood of the true labels (a finer score than accuracy when a
    small validation set is answered all right)."""
    if len(frames) == 0:
        return 0.0
    logits = net_logits(net, frames)
    target = torch.as_tensor(np.array(labels, dtype=np.int64))
    return float(torch.nn.functional.cross_entropy(logits, target))


def fit_temperature(
    net: nn.Module,
    frames: np.ndarray,
    labels: np.ndarray,
    *,
    bounds: tuple[float, float] = (0.25, 8.0),
) -> float:
    """The softmax temperature at which the network's mean confidence equals its accuracy.

    Temperature scaling leaves every prediction as it is and only rescales the
    confidence, so an edge threshold on confidence keeps its meaning from one student
    to the next: at the fitted temperature, a confidence of 0.9 is right about nine
    times in ten on these frames. Mean confidence falls monotonically with the
    temperature, so a bisection on log T finds it; a network with every frame right
    gets the lower bound.
    """
    if len(frames) == 0:
        return 1.0
    logits = net_logits(net, frames)
    accuracy = float((logits.argmax(1).numpy() == np.asarray(labels)).mean())

    def mean_confidence(t: float) -> float:
        return float(torch.softmax(logits / t, dim=1).max(dim=1).values.mean())

    lo, hi = np.log(bounds[0]), np.log(bounds[1])
    if mean_confidence(float(np.exp(lo))) <= accuracy:
        return float(bounds[0])
    if mean_confidence(float(np.exp(hi))) >= accuracy:
        return float(bounds[1])
    for _ in range(40):
        mid = (lo + hi) / 2
        if mean_confidence(float(np.exp(mid))) > accuracy:
            lo = mid
        else:
            hi = mid
    return float(np.exp((lo + hi) / 2))


def fold_temperature(net: nn.Module, temperature: float) -> nn.Module:
    """Divide the network's logits by ``temperature`` by scaling its last linear layer.

    ``softmax(W x / T + b / T)`` is exactly the tempered softmax, so the exported
    model carries its calibration with no extra node.
    """
    last = [m for m in net.modules() if isinstance(m, nn.Linear)]
    if not last:
        raise ModelError("the network has no final linear layer to fold a temperature into")
    with torch.no_grad():
        last[-1].weight.div_(temperature)
        if last[-1].bias is not None:
            last[-1].bias.div_(temperature)
    return net


def random_shift(frames: np.ndarray, rng: np.random.Generator, max_px: int = 4) -> np.ndarray:
    """Move each frame by up to ``max_px`` pixels each way (edges repeated): a camera that
    sits a little differently, an object a little off its mark."""
    n, h, w, _ = frames.shape
    padded = np.pad(frames, ((0, 0), (max_px, max_px), (max_px, max_px), (0, 0)), mode="edge")
    out = np.empty_like(frames)
    offsets = rng.integers(0, 2 * max_px + 1, size=(n, 2)).tolist()
    for i, (dy, dx) in enumerate(offsets):
        out[i] = padded[i, dy : dy + h, dx : dx + w]
    return out


def _augment(
    frames: np.ndarray, masks: np.ndarray | None, rng: np.random.Generator, p_clean: float
) -> np.ndarray:
    out = frames.copy()
    for i in range(len(frames)):
        spec = random_drift_spec(rng, p_clean=p_clean)
        if spec:
            seed = [int(x) for x in rng.integers(0, 2**31, size=2)]
            out[i] = apply_drift_frame(frames[i], spec, seed, None if masks is None else masks[i])
    return out


def random_drifts(
    frames: np.ndarray, masks: np.ndarray | None, rng: np.random.Generator, p_clean: float = 0.0
) -> np.ndarray:
    """Each frame under its own random mix of drifts (``p_clean`` of them left clean)."""
    return _augment(frames, masks, rng, p_clean)


class _Batches:
    """Shuffled ``(index, uint8 frames)`` batches of a frame set, one epoch at a time.

    Every batch draws its drift augmentation from its own generator (seed, epoch,
    step), so a batch is the same whatever came before it. (Augmenting one batch
    ahead in a worker thread was tried and made teacher epochs 2.5x slower on two
    cores: the per-frame Python work holds the GIL and a third busy thread starves
    torch's two OpenMP threads.)
    """

    def __init__(self, data: FrameSet, cfg: TrainConfig, augment: Augment | None = None) -> None:
        self.data, self.cfg, self.augment = data, cfg, augment

    def __len__(self) -> int:
        return (len(self.data) + self.cfg.batch_size - 1) // self.cfg.batch_size

    def epoch(self, epoch: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        order = np.random.default_rng([self.cfg.seed, epoch]).permutation(len(self.data))
        bs = self.cfg.batch_size
        for step, start in enumerate(range(0, len(order), bs)):
            idx = np.sort(order[start : start + bs])
            frames = self.data.frames[idx]  # uint8 [B, H, W, 3]
            if self.cfg.augment_drift:
                masks = None if self.data.masks is None else self.data.masks[idx]
                rng = np.random.default_rng([self.cfg.seed, epoch, step])
                frames = _augment(frames, masks, rng, self.cfg.p_clean)
            if self.augment is not None:
                frames = self.augment(
                    frames, np.random.default_rng([self.cfg.seed, epoch, step, 1])
                )
            yield idx, frames


def _progress(enabled: bool, console: Console | None) -> Progress:
    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console or Console(stderr=True),
        disable=not enabled,
        transient=False,
    )


# ---------------------------------------------------------------------------------
# The run


def train(
    config: TrainConfig,
    train_set: FrameSet,
    val_set: FrameSet | None = None,
    *,
    soft_targets: np.ndarray | None = None,
    checkpoint: Path | None = None,
    name: str = "edgeloop-model",
    version: str = "0",
    progress: bool = True,
    console: Console | None = None,
    init_state: Mapping[str, torch.Tensor] | None = None,
    on_step: Callable[[int, int], None] | None = None,
    patience: int | None = None,
    augment: Augment | None = None,
    keep_last: bool = False,
) -> TrainResult:
    """Train one model on ``train_set``; keep the weights that score best on ``val_set``
    (with ``keep_last``, the last epoch's, which the one-cycle schedule anneals to).

    ``init_state`` warm-starts from existing weights (a state dict of the same
    architecture); ``on_step(step, total_steps)`` is called after every optimizer step
    (a distill job checks for cancel there: it may raise to stop training);
    ``patience`` stops early after that many epochs without a better validation score;
    ``augment(frames, rng)`` transforms each training batch (uint8 NHWC in and out).
    """
    started = time.perf_counter()
    cfg = config

    # -- data --------------------------------------------------------------------
    if len(train_set) == 0:
        raise DataError("the training set is empty")
    if train_set.frame_size != cfg.frame_size:
        raise DataError(
            f"training frames are {train_set.frame_size} px but the config says {cfg.frame_size}"
        )
    if soft_targets is not None and soft_targets.shape != (len(train_set), train_set.num_classes):
        raise DataError(
            f"teacher scores must be [{len(train_set)}, {train_set.num_classes}],"
            f" got {soft_targets.shape}"
        )
    y_train = torch.tensor(train_set.labels, dtype=torch.int64)
    teacher = None if soft_targets is None else torch.from_numpy(soft_targets.astype(np.float32))
    torch.manual_seed(cfg.seed)
    # Validation under drift: one fixed random mix, so scores compare across epochs.
    val_drifted = None
    if val_set is not None and cfg.augment_drift:
        val_rng = np.random.default_rng([cfg.seed, 2718])
        val_drifted = _augment(val_set.frames, val_set.masks, val_rng, p_clean=0.0)

    # -- model -------------------------------------------------------------------
    # channels_last: oneDNN's CPU convolutions train ~20% faster in NHWC memory order.
    # (torch's stubs omit Module.to's memory_format keyword, hence the ignore.)
    net = build_model(cfg.arch, train_set.num_classes, cfg.width)
    if init_state is not None:
        try:
            net.load_state_dict(dict(init_state))
        except RuntimeError as exc:
            raise ModelError(f"cannot warm-start {cfg.arch} from the given weights: {exc}") from exc
    net = net.to(memory_format=torch.channels_last)  # type: ignore[call-overload]
    optimizer = torch.optim.AdamW(net.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    steps_per_epoch = (len(train_set) + cfg.batch_size - 1) // cfg.batch_size
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=cfg.lr, total_steps=cfg.epochs * steps_per_epoch, pct_start=0.15
    )
    best_score, best_state, best_epoch = -1.0, copy.deepcopy(net.state_dict()), 0
    history: list[dict[str, float]] = []
    meta = ModelMeta(
        arch=cfg.arch,
        num_classes=train_set.num_classes,
        class_names=train_set.class_names,
        frame_size=cfg.frame_size,
        width=cfg.width,
        name=name,
        version=version,
        train_config=cfg.cache_fields(),
    )

    # -- loop --------------------------------------------------------------------
    batches = _Batches(train_set, cfg, augment)
    with torch_threads(cfg.threads), _progress(progress, console) as bar:
        step = 0
        task = bar.add_task(f"train {cfg.role}", total=cfg.epochs * steps_per_epoch, status="")
        for epoch in range(1, cfg.epochs + 1):
            net.train()
            seen, loss_sum = 0, 0.0
            for idx, frames in batches.epoch(epoch):  # frames: uint8 [B, H, W, 3]
                # float [B, 3, H, W], NHWC in memory
                x = frames_to_input(frames).contiguous(memory_format=torch.channels_last)
                y = y_train[idx]  # [B]

                logits = net(x)  # [B, classes]
                loss = distillation_loss(
                    logits,
                    y,
                    None if teacher is None else teacher[idx],
                    temperature=cfg.temperature,
                    alpha=cfg.alpha,
                    label_smoothing=cfg.label_smoothing,
                )
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                scheduler.step()

                seen += len(idx)
                loss_sum += loss.item() * len(idx)
                bar.update(task, advance=1, status=f"epoch {epoch} loss {loss_sum / seen:.3f}")
                step += 1
                if on_step is not None:
                    on_step(step, cfg.epochs * steps_per_epoch)

            # evaluate
            record = {"epoch": float(epoch), "loss": loss_sum / seen}
            score = -record["loss"]  # without validation data, the lowest loss wins
            if val_set is not None:
                record["val_acc"] = evaluate_net(net, val_set.frames, val_set.labels)
                score = record["val_acc"]
                if val_drifted is not None:
                    record["val_acc_drift"] = evaluate_net(net, val_drifted, val_set.labels)
                    score = (record["val_acc"] + record["val_acc_drift"]) / 2
            history.append(record)
            bar.update(
                task,
                status=" ".join(f"{k} {v:.3f}" for k, v in record.items() if k != "epoch"),
            )

            # checkpoint (on a tie the later, further-annealed weights win)
            if keep_last or score >= best_score:
                best_score, best_epoch = score, epoch
                best_state = copy.deepcopy(net.state_dict())
                if checkpoint is not None:
                    save_checkpoint(checkpoint, net, meta)
            elif patience is not None and epoch - best_epoch >= patience:
                break  # early stopping: no better validation score for `patience` epochs

    net.load_state_dict(best_state)
    net = net.to(memory_format=torch.contiguous_format)
    net.eval()
    wall = time.perf_counter() - started
    best = history[best_epoch - 1]
    metrics: dict[str, Any] = {
        "role": cfg.role,
        "arch": cfg.arch,
        "best_epoch": best_epoch,
        "epochs": cfg.epochs,
        "train_frames": len(train_set),
        "train_wall_s": round(wall, 2),
        "frames_per_s": round(cfg.epochs * len(train_set) / wall, 1),
        "distilled": teacher is not None,
        **{k: v for k, v in best.items() if k != "epoch"},
    }
    return TrainResult(net=net, config=cfg, metrics=metrics, history=history)
