"""The in-memory form of a labelled frame collection, shared by the scenario and folder loaders."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["FrameSet"]


@dataclass(frozen=True, eq=False)
class FrameSet:
    """Labelled RGB frames, uint8 NHWC, all of one square size.

    ``masks`` (digit coverage in [0, 1], float32 [N, H, W]) is known only for
    rendered frames; drifts that need to know where the object is (background
    change) use it and fall back to a whole-frame effect without it.
    ``sources`` names the source scan of each frame so splits can be checked
    for leakage. ``identity`` is a stable description used in cache keys.
    """

    frames: np.ndarray  # uint8 [N, H, W, 3]
    labels: np.ndarray  # int64 [N], indexes into class_names
    class_names: tuple[str, ...]
    masks: np.ndarray | None = None  # float32 [N, H, W]
    sources: np.ndarray | None = None  # int64 [N]
    identity: str = ""
    notes: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.frames.dtype != np.uint8 or self.frames.ndim != 4 or self.frames.shape[-1] != 3:
            raise ValueError(
                f"frames must be uint8 [N, H, W, 3], got {self.frames.dtype} {self.frames.shape}"
            )
        if self.frames.shape[1] != self.frames.shape[2]:
            raise ValueError(f"frames must be square, got {self.frames.shape[1:3]}")
        n = len(self.frames)
        if self.labels.shape != (n,):
            raise ValueError(f"labels must be [N={n}], got {self.labels.shape}")
        if self.masks is not None and self.masks.shape != self.frames.shape[:3]:
            raise ValueError(f"masks must be [N, H, W], got {self.masks.shape}")
        if self.sources is not None and self.sources.shape != (n,):
            raise ValueError(f"sources must be [N={n}], got {self.sources.shape}")

    def __len__(self) -> int:
        return len(self.frames)

    @property
    def frame_size(self) -> int:
        return int(self.frames.shape[1])

    @property
    def num_classes(self) -> int:
        return len(self.class_names)

    def subset(self, index: np.ndarray | slice) -> FrameSet:
        """Frames at ``index`` (a slice, integer or boolean array), same class names."""
        return FrameSet(
            frames=self.frames[index],
            labels=self.labels[index],
            class_names=self.class_names,
            masks=None if self.masks is None else self.masks[index],
            sources=None if self.sources is None else self.sources[index],
            identity=f"{self.identity}[subset]",
            notes=dict(self.notes),
        )

    def class_counts(self) -> dict[str, int]:
        counts = np.bincount(self.labels, minlength=self.num_classes)
        return {name: int(c) for name, c in zip(self.class_names, counts, strict=True)}
