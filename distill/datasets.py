"""Bring your own data: labelled images in a common layout, or ``digits`` for the built-in
scenario. Three layouts are read, told apart by ``detect_format`` (or named):

**ImageFolder** (``imagefolder``)::

    ROOT/
      <class name>/      one subfolder per class; class names = subfolder names, sorted
        <image files>    any format Pillow reads; nested folders are searched too

  Ultralytics' *classification* layout is the same with the splits as folders,
  ``ROOT/train/<class>/...``, ``ROOT/val/<class>/...`` (and ``ROOT/test/<class>/...``);
  those folders are then the splits.

**COCO JSON** (``coco``): ``--data path/to/annotations.json`` with the images beside it
(``file_name`` is looked up next to the file, in ``images/`` there, and one folder up).
An image's class is its annotations' category when they all share one, else the
category of its largest box; classes are the categories in id order. Images without
annotations are skipped and counted.

**YOLO txt** (``yolo``): detection labels, one ``.txt`` per image with lines
``class cx cy w h`` (normalised; segmentation polygons are read as their bounding
box), either in ``ROOT/labels/...`` mirroring ``ROOT/images/...`` or beside the
images. An image's class is its largest box's. Class names come from ``data.yaml``
(``names:`` as a list or an id mapping) or ``classes.txt`` (one per line). Split
folders (``images/train``, ``images/val``, ``images/test``) are the splits.

Images are converted to RGB and resized to the model's square frame size (aspect
ratio is not kept: the whole image is the frame, as a camera would deliver it).
Files that cannot be decoded (corrupt, truncated, not images at all) are skipped and
counted; hidden files (``.DS_Store``) are ignored. A source with no class or no
readable image raises DataError saying what layout is expected.

Without split folders, ``train``/``validation``/``test`` are assigned per image by a
hash of its path inside the root (70/15/15): stable when files are added, and never
sharing a file. ``all`` is every image (e.g. a separate evaluation folder).
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageOps

from distill.frames import FrameSet
from distill.scenario import SPLITS, ScenarioConfig, render_split
from shared.errors import DataError

__all__ = [
    "DATA_FORMATS",
    "DIGITS",
    "FOLDER_SPLITS",
    "LoadedData",
    "SkippedFile",
    "detect_format",
    "folder_split_of",
    "load_coco",
    "load_data",
    "load_image_folder",
    "load_yolo",
    "write_image_folder",
]

DIGITS = "digits"
DATA_FORMATS: tuple[str, ...] = ("auto", "imagefolder", "coco", "yolo")
FOLDER_SPLITS: tuple[str, ...] = ("all", "train", "validation", "test")
_FOLDER_FRACTIONS = (0.70, 0.15, 0.15)
_LAYOUT = (
    "expected ROOT/<class name>/<image files>: one subfolder per class, named after the"
    " class, holding that class's images"
)
_COCO_LAYOUT = (
    "expected a COCO JSON file with 'images', 'annotations' and 'categories', its images beside it"
)
_YOLO_LAYOUT = (
    "expected YOLO txt labels (one 'class cx cy w h' line per box) in ROOT/labels/ or beside"
    " the images, and class names in ROOT/data.yaml (names:) or ROOT/classes.txt"
)
_IMAGE_SUFFIXES = frozenset(
    {".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".ppm", ".pgm"}
)
# Split folder names as Ultralytics and common exports write them.
_SPLIT_DIRS = {"train": "train", "val": "validation", "valid": "validation", "test": "test"}


@dataclass(frozen=True)
class SkippedFile:
    path: Path
    reason: str


@dataclass(frozen=True)
class LoadedData:
    frames: FrameSet
    source: str  # "digits" or the folder / annotation file path
    split: str
    skipped: tuple[SkippedFile, ...] = ()
    format: str = "imagefolder"

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


def _files(folder: Path, root: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and _visible(p, root))


def _subdirs(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


@dataclass(frozen=True)
class _Item:
    """One image of a dataset: its class (None: skipped for ``reason``) and its split
    (None: assigned by the hash of ``key``, its path inside the root)."""

    path: Path
    key: str
    label: int | None
    split: str | None = None
    reason: str = ""


def _check_split(split: str) -> None:
    if split not in FOLDER_SPLITS:
        raise DataError(
            f"unknown split {split!r} for a folder; use one of {', '.join(FOLDER_SPLITS)}"
        )


def _load_items(
    items: Iterable[_Item],
    class_names: Sequence[str],
    *,
    source: Path,
    kind: str,
    split: str,
    frame_size: int,
    layout: str,
) -> LoadedData:
    """Decode the items of ``split`` into a LoadedData; DataError when none is readable."""
    frames: list[np.ndarray] = []
    labels: list[int] = []
    skipped: list[SkippedFile] = []
    fingerprint = hashlib.sha256()
    for item in items:
        if split != "all" and (item.split or folder_split_of(item.key)) != split:
            continue
        if item.label is None:
            skipped.append(SkippedFile(item.path, item.reason))
            continue
        try:
            frames.append(_read_image(item.path, frame_size))
        except Exception as exc:  # any decoder failure means "unreadable", by design
            skipped.append(SkippedFile(item.path, f"{type(exc).__name__}: {exc}"))
            continue
        labels.append(item.label)
        stat = item.path.stat()
        fingerprint.update(
            f"{item.key}\0{item.label}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode()
        )
    if not frames:
        where = "" if split == "all" else f" in split {split!r}"
        extra = f" ({len(skipped)} file(s) could not be read)" if skipped else ""
        raise DataError(f"{source} has no readable images{where}{extra}; {layout}")
    return LoadedData(
        frames=FrameSet(
            frames=np.stack(frames),
            labels=np.asarray(labels, dtype=np.int64),
            class_names=tuple(class_names),
            identity=f"{kind}:{source.resolve()}:{fingerprint.hexdigest()[:16]}/{split}",
            notes={"split": split, "format": kind},
        ),
        source=str(source),
        split=split,
        skipped=tuple(skipped),
        format=kind,
    )


# ---------------------------------------------------------------------------------
# ImageFolder (and Ultralytics' classification layout)


def _split_folders(root: Path) -> dict[str, Path] | None:
    """``{split: folder}`` when every subfolder of ``root`` is a split holding class
    folders (Ultralytics' classification layout), else None."""
    subdirs = _subdirs(root)
    if not subdirs or any(d.name.lower() not in _SPLIT_DIRS for d in subdirs):
        return None
    if not all(_subdirs(d) for d in subdirs):
        return None
    return {_SPLIT_DIRS[d.name.lower()]: d for d in subdirs}


def load_image_folder(root: Path, *, frame_size: int, split: str = "all") -> LoadedData:
    """Load ``root/<class>/<images>`` (or ``root/<split>/<class>/<images>``) as frames of
    ``frame_size`` px; see the module docstring."""
    root = Path(root).expanduser()
    _check_split(split)
    if not root.is_dir():
        raise DataError(f"no such folder: {root} ({_LAYOUT})")
    splits = _split_folders(root)
    parts = splits.items() if splits else [(None, root)]
    class_names = sorted({d.name for _, folder in parts for d in _subdirs(folder)})
    if not class_names:
        raise DataError(f"{root} has no class subfolders; {_LAYOUT}")
    index = {name: i for i, name in enumerate(class_names)}
    items = [
        _Item(path, path.relative_to(root).as_posix(), index[class_dir.name], part)
        for part, folder in parts
        for class_dir in _subdirs(folder)
        for path in _files(class_dir, root)
    ]
    return _load_items(
        items,
        class_names,
        source=root,
        kind="imagefolder",
        split=split,
        frame_size=frame_size,
        layout=_LAYOUT,
    )


# ---------------------------------------------------------------------------------
# COCO JSON


def _coco_image_path(annotations: Path, file_name: str) -> Path | None:
    here = annotations.parent
    for folder in (here, here / "images", here.parent, here.parent / "images"):
        candidate = folder / file_name
        if candidate.is_file():
            return candidate
    return None


def _box_area(annotation: dict[str, Any]) -> float:
    box = annotation.get("bbox")
    if isinstance(box, list) and len(box) == 4:
        return float(box[2]) * float(box[3])
    return float(annotation.get("area") or 0.0)


def load_coco(annotations: Path, *, frame_size: int, split: str = "all") -> LoadedData:
    """Load a COCO JSON file's images with one class each; see the module docstring."""
    annotations = Path(annotations).expanduser()
    _check_split(split)
    if not annotations.is_file():
        raise DataError(f"no such file: {annotations} ({_COCO_LAYOUT})")
    try:
        doc = json.loads(annotations.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"cannot read {annotations} as JSON: {exc}") from exc
    if not isinstance(doc, dict) or not all(
        isinstance(doc.get(k), list) for k in ("images", "annotations", "categories")
    ):
        raise DataError(f"{annotations} is not COCO JSON; {_COCO_LAYOUT}")
    try:
        categories = sorted((int(c["id"]), str(c["name"])) for c in doc["categories"])
        images = {int(im["id"]): str(im["file_name"]) for im in doc["images"]}
        by_image: dict[int, list[dict[str, Any]]] = {}
        for a in doc["annotations"]:
            by_image.setdefault(int(a["image_id"]), []).append(a)
            int(a["category_id"])
    except (KeyError, TypeError, ValueError) as exc:
        raise DataError(
            f"{annotations} has a malformed entry ({type(exc).__name__}: {exc}); {_COCO_LAYOUT}"
        ) from exc
    if not categories:
        raise DataError(f"{annotations} has no categories; {_COCO_LAYOUT}")
    class_names = [name for _, name in categories]
    index = {cid: i for i, (cid, _) in enumerate(categories)}
    items = []
    for image_id, file_name in sorted(images.items()):
        path = _coco_image_path(annotations, file_name)
        key = Path(file_name).as_posix()
        if path is None:
            items.append(_Item(annotations.parent / file_name, key, None, reason="image not found"))
            continue
        anns = by_image.get(image_id, [])
        cats = {int(a["category_id"]) for a in anns}
        if not anns:
            items.append(_Item(path, key, None, reason="no annotations"))
            continue
        chosen = cats.pop() if len(cats) == 1 else int(max(anns, key=_box_area)["category_id"])
        if chosen not in index:
            items.append(_Item(path, key, None, reason=f"unknown category {chosen}"))
            continue
        items.append(_Item(path, key, index[chosen]))
    return _load_items(
        items,
        class_names,
        source=annotations,
        kind="coco",
        split=split,
        frame_size=frame_size,
        layout=_COCO_LAYOUT,
    )


# ---------------------------------------------------------------------------------
# YOLO txt


def _yolo_names(root: Path) -> list[str]:
    for name in ("data.yaml", "data.yml", "dataset.yaml"):
        path = root / name
        if path.is_file():
            import yaml

            try:
                doc = yaml.safe_load(path.read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
                raise DataError(f"cannot read {path}: {exc}") from exc
            names = doc.get("names") if isinstance(doc, dict) else None
            if isinstance(names, list) and names:
                return [str(n) for n in names]
            if isinstance(names, dict) and names:
                ids = sorted(int(k) for k in names)
                if ids != list(range(len(ids))):
                    raise DataError(f"{path}: names ids must be 0..{len(ids) - 1}, got {ids}")
                return [str(names[k] if k in names else names[str(k)]) for k in ids]
            raise DataError(f"{path} has no 'names' list or mapping; {_YOLO_LAYOUT}")
    path = root / "classes.txt"
    if path.is_file():
        names = [line.strip() for line in path.read_text(encoding="utf-8").splitlines()]
        if any(names):
            return [n for n in names if n]
    raise DataError(f"{root} has no data.yaml or classes.txt naming the classes; {_YOLO_LAYOUT}")


def _yolo_label_file(image: Path, root: Path) -> Path:
    rel = image.relative_to(root).parts
    if "images" in rel:
        i = len(rel) - 1 - rel[::-1].index("images")
        return root.joinpath(*rel[:i], "labels", *rel[i + 1 :]).with_suffix(".txt")
    return image.with_suffix(".txt")


def _largest_box_class(label_file: Path, classes: int) -> tuple[int | None, str]:
    best, best_area = None, -1.0
    try:
        lines = label_file.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"cannot read {label_file.name}: {exc}"
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if not fields:
            continue
        try:
            cls, coords = int(fields[0]), [float(x) for x in fields[1:]]
        except ValueError:
            return None, f"{label_file.name} line {number} is not 'class cx cy w h'"
        if len(coords) == 4:
            area = coords[2] * coords[3]
        elif len(coords) >= 6 and len(coords) % 2 == 0:  # a polygon: its bounding box
            xs, ys = coords[0::2], coords[1::2]
            area = (max(xs) - min(xs)) * (max(ys) - min(ys))
        else:
            return None, f"{label_file.name} line {number} is not 'class cx cy w h'"
        if not 0 <= cls < classes:
            return None, f"{label_file.name} line {number}: class {cls} outside 0..{classes - 1}"
        if area > best_area:
            best, best_area = cls, area
    return (best, "") if best is not None else (None, "no boxes in its label file")


def load_yolo(root: Path, *, frame_size: int, split: str = "all") -> LoadedData:
    """Load YOLO detection labels as one class per image (the largest box's)."""
    root = Path(root).expanduser()
    _check_split(split)
    if not root.is_dir():
        raise DataError(f"no such folder: {root} ({_YOLO_LAYOUT})")
    names = _yolo_names(root)
    items = []
    for path in _files(root, root):
        if path.suffix.lower() not in _IMAGE_SUFFIXES:
            continue
        rel = path.relative_to(root).parts
        part = next((_SPLIT_DIRS[p.lower()] for p in rel[:-1] if p.lower() in _SPLIT_DIRS), None)
        label_file = _yolo_label_file(path, root)
        key = path.relative_to(root).as_posix()
        if not label_file.is_file():
            items.append(_Item(path, key, None, part, reason="no label file"))
            continue
        label, reason = _largest_box_class(label_file, len(names))
        items.append(_Item(path, key, label, part, reason=reason))
    return _load_items(
        items,
        names,
        source=root,
        kind="yolo",
        split=split,
        frame_size=frame_size,
        layout=_YOLO_LAYOUT,
    )


# ---------------------------------------------------------------------------------
# One entry point


def _coco_in(folder: Path) -> Path | None:
    """The one COCO JSON file directly in ``folder`` (or its annotations/), if there is one."""
    found = []
    for candidate in sorted([*folder.glob("*.json"), *folder.glob("annotations/*.json")]):
        try:
            with candidate.open("rb") as handle:
                head = handle.read(1 << 16)
        except OSError:
            continue
        if b'"images"' in head or b'"annotations"' in head or b'"categories"' in head:
            found.append(candidate)
    return found[0] if len(found) == 1 else None


def detect_format(source: str | Path) -> str:
    """``coco``, ``yolo`` or ``imagefolder``, from what the path holds."""
    path = Path(source).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".json":
            return "coco"
        raise DataError(
            f"{path} is a file; give a COCO .json file or a folder (ImageFolder or YOLO)"
        )
    if not path.is_dir():
        raise DataError(f"no such folder: {path} ({_LAYOUT})")
    if any((path / n).is_file() for n in ("data.yaml", "data.yml", "dataset.yaml", "classes.txt")):
        return "yolo"
    if (path / "labels").is_dir() and (path / "images").is_dir():
        return "yolo"
    if _coco_in(path) is not None:
        return "coco"
    return "imagefolder"


def load_data(
    source: str | Path,
    *,
    split: str | None = None,
    frame_size: int = 64,
    scenario: ScenarioConfig | None = None,
    format: str = "auto",
) -> LoadedData:
    """``"digits"`` (the built-in scenario) or a dataset path, at ``frame_size`` px.

    ``format`` is one of DATA_FORMATS (``auto`` detects it). ``split`` defaults to
    ``test`` for digits and ``all`` for a dataset.
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
        return LoadedData(
            frames=render_split(split, config), source=DIGITS, split=split, format=DIGITS
        )
    if format not in DATA_FORMATS:
        raise DataError(f"unknown data format {format!r}; use one of {', '.join(DATA_FORMATS)}")
    kind = detect_format(source) if format == "auto" else format
    path, split = Path(source).expanduser(), split or "all"
    if kind == "coco":
        if path.is_dir():
            found = _coco_in(path)
            if found is None:
                raise DataError(f"{path} holds no single COCO JSON file; {_COCO_LAYOUT}")
            path = found
        return load_coco(path, frame_size=frame_size, split=split)
    if kind == "yolo":
        return load_yolo(path, frame_size=frame_size, split=split)
    return load_image_folder(path, frame_size=frame_size, split=split)


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
