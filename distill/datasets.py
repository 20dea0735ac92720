"""Bring your own data: a folder of labelled images, or ``digits`` for the built-in scenario.

Folder layout (the common "image folder" convention)::

    ROOT/
      <class name>/      one subfolder per class; class names = subfolder names, sorted
        <image files>    any format Pillow reads; nested folders are searched too

Images are converted to RGB and resized to the model's square frame size (aspect
ratio is not kept: the whole image is the frame, as a camera would deliver it).
Files that cannot be decoded (corrupt, truncated, not images at all) are skipped and
counted; hidden files (``.DS_Store``) are ignored. A folder with no class subfolders
or no readable image raises DataError saying what layout is expected.

Folders have no fixed splits, so ``train``/``validation``/``test`` are assigned per
file by a hash of its path inside ROOT (70/15/15): stable when files are added,
and never sharing a file. ``all`` is every file (e.g. a separate evaluation folder).
"""

from __future__ import annotations

import hashlib
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps

from distill.frames import FrameSet
from distill.scenario import SPLITS, ScenarioConfig, render_split
from shared.errors import DataError

__all__ = [
    "DIGITS",
    "FOLDER_SPLITS",
    "LoadedData",
    "SkippedFile",
    "folder_split_of",
    "load_data",
    "load_image_folder",
    "write_image_folder",
]

DIGITS = "digits"
FOLDER_SPLITS: tuple[str, ...] = ("all", "train", "validation", "test")
_FOLDER_FRACTIONS = (0.70, 0.15, 0.15)
_LAYOUT = (
    "expected ROOT/<class name>/<image files>: one subfolder per class, named after the"
    " class, holding that class's images"
)


@dataclass(frozen=True)
class SkippedFile:
    path: Path
    reason: str


@dataclass(frozen=True)
class LoadedData:
    frames: FrameSet
    source: str  # "digits" or the folder path
    split: str
    skipped: tuple[SkippedFile, ...] = ()

    @property
    def skipped_count(self) -> int:
        return len(self.skipped)

    def describe(self) -> str:
        counts = self.frames.class_counts()
        text = (
            f"{len(self.frames)} frames, {len(counts)} classes,"
            f" split {self.split}, from {self.source}"
        )
        if self.skipped:
            text += f"; skipped {len(self.skipped)} unreadable file(s)"
        return text


def folder_split_of(relative_path: str) -> str:
    """The split a file belongs to, from a hash of its path inside the dataset root."""
    digest = hashlib.sha256(relative_path.encode("utf-8")).digest()
    u = int.from_bytes(digest[:8], "big") / 2**64
    train, val, _ = _FOLDER_FRACTIONS
    if u < train:
        return "train"
    return "validation" if u < train + val else "test"


def _read_image(path: Path, frame_size: int) -> np.ndarray:
    with warnings.catch_warnings():
        # An image big enough to trip Pillow's decompression-bomb check is treated
        # as unreadable rather than a process-wide warning.
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with Image.open(path) as img:
            img.draft("RGB", (frame_size * 2, frame_size * 2))  # JPEG: decode at reduced size
            upright = ImageOps.exif_transpose(img)
            rgb = upright.convert("RGB").resize((frame_size, frame_size), Image.Resampling.BILINEAR)
            return np.asarray(rgb, dtype=np.uint8)


def _visible(path: Path, root: Path) -> bool:
    return not any(part.startswith(".") for part in path.relative_to(root).parts)


def load_image_folder(root: Path, *, frame_size: int, split: str = "all") -> LoadedData:
    """Load ``root/<class>/<images>`` as frames of ``frame_size`` px; see module docstring."""
    root = Path(root).expanduser()
    if split not in FOLDER_SPLITS:
        raise DataError(
            f"unknown split {split!r} for a folder; use one of {', '.join(FOLDER_SPLITS)}"
        )
    if not root.is_dir():
        raise DataError(f"no such folder: {root} ({_LAYOUT})")
    class_dirs = sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("."))
    if not class_dirs:
        raise DataError(f"{root} has no class subfolders; {_LAYOUT}")
    class_names = tuple(p.name for p in class_dirs)
    frames: list[np.ndarray] = []
    labels: list[int] = []
    skipped: list[SkippedFile] = []
    fingerprint = hashlib.sha256()
    for label, class_dir in enumerate(class_dirs):
        files = sorted(p for p in class_dir.rglob("*") if p.is_file() and _visible(p, root))
        for path in files:
            rel = path.relative_to(root).as_posix()
            if split != "all" and folder_split_of(rel) != split:
                continue
            try:
                frames.append(_read_image(path, frame_size))
            except Exception as exc:  # any decoder failure means "unreadable", by design
                skipped.append(SkippedFile(path, f"{type(exc).__name__}: {exc}"))
                continue
            labels.append(label)
            stat = path.stat()
            fingerprint.update(f"{rel}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    if not frames:
        where = "" if split == "all" else f" in split {split!r}"
        extra = f" ({len(skipped)} file(s) could not be read)" if skipped else ""
        raise DataError(f"{root} has no readable images{where}{extra}; {_LAYOUT}")
    return LoadedData(
        frames=FrameSet(
            frames=np.stack(frames),
            labels=np.asarray(labels, dtype=np.int64),
            class_names=class_names,
            identity=f"folder:{root.resolve()}:{fingerprint.hexdigest()[:16]}/{split}",
            notes={"split": split},
        ),
        source=str(root),
        split=split,
        skipped=tuple(skipped),
    )


def load_data(
    source: str | Path,
    *,
    split: str | None = None,
    frame_size: int = 64,
    scenario: ScenarioConfig | None = None,
) -> LoadedData:
    """``"digits"`` (the built-in scenario) or a folder path, at ``frame_size`` px.

    ``split`` defaults to ``test`` for digits and ``all`` for a folder.
    """
    if str(source) == DIGITS:
        split = split or "test"
        if split not in SPLITS:
            raise DataError(f"unknown split {split!r} for digits; use one of {', '.join(SPLITS)}")
        config = scenario or ScenarioConfig(frame_size=frame_size)
        if config.frame_size != frame_size:
            raise DataError(
                f"scenario renders {config.frame_size} px frames, {frame_size} px requested"
            )
        return LoadedData(frames=render_split(split, config), source=DIGITS, split=split)
    return load_image_folder(Path(source), frame_size=frame_size, split=split or "all")


def write_image_folder(data: FrameSet, root: Path, *, fmt: str = "png") -> list[Path]:
    """Write frames as ``root/<class>/<index>.<fmt>`` (the layout ``load_image_folder`` reads)."""
    root = Path(root)
    written: list[Path] = []
    for i, (frame, label) in enumerate(zip(data.frames, data.labels, strict=True)):
        d = root / data.class_names[int(label)]
        d.mkdir(parents=True, exist_ok=True)
        path = d / f"{i:05d}.{fmt}"
        Image.fromarray(frame).save(path)
        written.append(path)
    return written
