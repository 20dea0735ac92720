"""``edgeloop models train --task detection``: a detector from a user's COCO or YOLO folder."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from rich.console import Console

from distill.detection_formats import load_detection_folder
from distill.detector_folder import train_folder_detector

__all__ = ["train_detection_folder"]


def train_detection_folder(
    data: str,
    *,
    role: str,
    out: Path | None,
    frame_size: int,
    epochs: int | None,
    batch_size: int | None,
    lr: float | None,
    seed: int,
    console: Console,
) -> dict[str, Any]:
    """Load ``data`` at ``frame_size``, train the role's detector, write its files."""
    kind: Literal["teacher", "student"] = "teacher" if role == "teacher" else "student"
    frames = load_detection_folder(Path(data), frame_size)
    overrides: dict[str, Any] = {"seed": seed}
    for key, value in (("epochs", epochs), ("batch_size", batch_size), ("lr", lr)):
        if value is not None:
            overrides[key] = value
    name = f"edgeloop-{kind}-detector"
    return train_folder_detector(
        frames,
        out or Path(f"{name}.pt"),
        role=kind,
        name=name,
        overrides=overrides,
        progress=True,
        console=console,
    )
