"""Bring your own boxes: detection datasets as COCO JSON or YOLO txt, in and out.

``load_coco`` reads COCO detection JSON (``bbox`` [x, y, w, h] pixels; categories become
classes 0..C-1 in sorted id order; ``iscrowd`` regions are skipped and counted).
``load_yolo`` reads Ultralytics' layout: images under a folder named ``images``
(``ROOT/images/...`` or ``ROOT/<split>/images/...``), labels mirrored under ``labels``
as ``<stem>.txt`` with a ``class cx cy w h`` line (normalised; a polygon counts as its
bounding box) per box, class names from ``data.yaml`` or ``classes.txt``; an image
without a label file has no objects. ``load_detection_folder`` tells them apart.

Frames are square: without ``size`` every image must be square and all one size; with
``size`` each is resized to ``size`` x ``size`` *without* keeping its aspect ratio (a
plain resize: the whole image is the frame, as in ``distill.datasets``), its boxes
scaled per axis alike. EXIF orientation is applied, as annotation tools show images,
unless a COCO entry's width/height are the stored orientation's. Boxes are clipped to
the image; those left without area are dropped and counted (``notes["dropped_boxes"]``).
Unusable input raises ``DataError`` naming the file and what is accepted, as does a
dataset over ``MAX_IMAGES`` images or an image over ``MAX_BOXES_PER_IMAGE`` boxes.

The writers put frames in ``OUT/images/`` as PNG beside COCO's ``annotations.json`` (category
ids from 1; ``predictions.json`` in COCO's results format), YOLO's ``labels/``,
``classes.txt`` and ``data.yaml``, or Label Studio's ``tasks.json`` (rectangle labels;
ground truth as annotations, model output as scored predictions).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from xml.sax.saxutils import quoteattr

import numpy as np
from PIL import Image, ImageOps

from distill.scenes import DetectionSet
from shared.errors import DataError

__all__ = [
    "IMAGE_SUFFIXES",
    "MAX_BOXES_PER_IMAGE",
    "MAX_IMAGES",
    "Prediction",
    "WrittenDataset",
    "load_coco",
    "load_detection_folder",
    "load_yolo",
    "predictions_from_fractions",
    "write_coco",
    "write_labelstudio",
    "write_yolo",
]

MAX_IMAGES = 100_000
MAX_BOXES_PER_IMAGE = 300
MAX_JSON_BYTES = 1 << 30
_MAX_LABEL_BYTES = 1 << 20  # 300 boxes take about 15 KB; a label file of a MiB is not one
IMAGE_SUFFIXES = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"})
_YAML_NAMES = ("data.yaml", "data.yml", "dataset.yaml")
_COORD_SLACK = 0.01  # normalised coordinates this far outside 0..1 are clipped, not refused
_COCO_LAYOUT = "expected COCO JSON: images (id, file_name), annotations (image_id, category_id,"
_COCO_LAYOUT += " bbox [x, y, w, h] pixels), categories (id, name)"
_YOLO_LAYOUT = "expected YOLO: ROOT/images/*, ROOT/labels/<stem>.txt ('class cx cy w h' lines,"
_YOLO_LAYOUT += " normalised 0..1), names in ROOT/data.yaml (names:) or ROOT/classes.txt"
_TOO_MANY = f"over {MAX_BOXES_PER_IMAGE} boxes, the most read per image"
_ACCEPTED_IMAGES = "accepted images: " + ", ".join(sorted(IMAGE_SUFFIXES))

# One predicted box: (x1, y1, x2, y2 in pixels, score, class index).
Prediction = tuple[Sequence[float], float, int]


@dataclass(frozen=True)
class WrittenDataset:
    """What a writer produced: the label file, the images and any predictions file."""

    root: Path
    annotations: Path
    images: tuple[Path, ...]
    predictions: Path | None = None


def _read_image(path: Path, stored: tuple[int, int] | None = None) -> np.ndarray:
    """RGB uint8 [H, W, 3], EXIF orientation applied unless ``stored`` is the raw size."""
    if path.suffix.lower() not in IMAGE_SUFFIXES:
        raise DataError(f"{path} is not an image file; {_ACCEPTED_IMAGES}")
    try:
        with warnings.catch_warnings():
            # An image big enough to trip Pillow's decompression-bomb check is refused.
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            with Image.open(path) as img:
                upright = ImageOps.exif_transpose(img)
                if stored is not None and upright.size != stored and img.size == stored:
                    upright = img  # the annotations name the stored orientation
                return np.asarray(upright.convert("RGB"), dtype=np.uint8)
    except Exception as exc:  # any decoder failure means "not a readable image"
        raise DataError(
            f"cannot decode {path} as an image ({type(exc).__name__}: {exc}); {_ACCEPTED_IMAGES}"
        ) from exc


def _clean_boxes(boxes: Any, width: int, height: int) -> tuple[np.ndarray, np.ndarray]:
    """Boxes clipped to the image and a mask of those that keep some area."""
    b = np.array(boxes, dtype=np.float64).reshape(-1, 4)
    b[:, 0::2] = np.clip(b[:, 0::2], 0.0, width)
    b[:, 1::2] = np.clip(b[:, 1::2], 0.0, height)
    return b, (b[:, 2] > b[:, 0]) & (b[:, 3] > b[:, 1])


class _Assembly:
    """Frames and boxes gathered one image at a time, checked to be one square size."""

    def __init__(self, size: int | None) -> None:
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 8):
            raise DataError(f"size must be a whole number of pixels >= 8 or None, got {size!r}")
        self.size, self.dropped = size, 0
        self.frames: list[np.ndarray] = []
        self.boxes: list[np.ndarray] = []
        self.classes: list[np.ndarray] = []
        self.files: list[str] = []
        self.digest = hashlib.sha256(f"size={size}\n".encode())

    def add(self, path: Path, key: str, image: np.ndarray, boxes: Any, classes: Any) -> None:
        h, w = image.shape[:2]
        clipped, keep = _clean_boxes(boxes, w, h)
        self.dropped += int((~keep).sum())
        clipped = clipped[keep]
        if self.size is not None:
            if (w, h) != (self.size, self.size):
                resized = Image.fromarray(image).resize((self.size,) * 2, Image.Resampling.BILINEAR)
                image = np.asarray(resized, dtype=np.uint8)
            clipped = clipped * np.array([self.size / w, self.size / h] * 2)
        elif w != h or (self.frames and self.frames[0].shape != image.shape):
            first = self.frames[0].shape if self.frames else None
            raise DataError(
                f"{path} is {w}x{h}{f', the first image {first[1]}x{first[0]}' if first else ''}:"
                " without size= every image must be square and all one size; pass size="
            )
        self.frames.append(image)
        self.boxes.append(clipped.astype(np.float32))
        self.classes.append(np.asarray(classes, dtype=np.int64).reshape(-1)[keep])
        self.files.append(key)
        stat = path.stat()
        self.digest.update(f"{key}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
        self.digest.update(self.boxes[-1].tobytes() + self.classes[-1].tobytes())

    def build(self, names: Sequence[str], kind: str, source: Path, **extra: object) -> DetectionSet:
        extra["dropped_boxes"] = self.dropped
        if not self.frames:  # a COCO file without images is refused before
            raise DataError(f"{source} has no images; {_YOLO_LAYOUT}")
        ident = f"{kind}:{source.resolve()}:{self.digest.hexdigest()[:16]}"
        notes = dict(format=kind, source=str(source), files=tuple(self.files), **extra)
        frames, classes = np.stack(self.frames), self.classes
        return DetectionSet(frames, self.boxes, classes, tuple(names), identity=ident, notes=notes)


def _get(entry: Any, key: str, where: str, path: Path, kind: type = int) -> Any:
    """``entry[key]`` as ``kind`` (int: a whole number; str: non-empty), else DataError."""
    value = entry.get(key) if isinstance(entry, dict) else None
    if kind is int and (type(value) is int or (type(value) is float and value.is_integer())):
        return int(value)
    if kind is str and isinstance(value, str) and value:
        return value
    wanted = "an integer" if kind is int else "a non-empty string"
    raise DataError(f"{path}: {where}.{key} must be {wanted}, got {value!r}; {_COCO_LAYOUT}")


def _coco_file(images_dir: Path, file_name: str) -> Path | None:
    name = PurePosixPath(file_name.replace("\\", "/"))
    inside = not name.is_absolute() and ".." not in name.parts  # never outside images_dir
    found = [c for c in [images_dir / name] * inside + [images_dir / name.name] if c.is_file()]
    return found[0] if found else None


def load_coco(annotations_json: Path, images_dir: Path, *, size: int | None = None) -> DetectionSet:
    """A COCO detection file and its images as a DetectionSet; see the module docstring."""
    path, images_dir = Path(annotations_json).expanduser(), Path(images_dir).expanduser()
    out = _Assembly(size)
    if not path.is_file():
        raise DataError(f"no such file: {path}; {_COCO_LAYOUT}")
    if path.stat().st_size > MAX_JSON_BYTES:
        raise DataError(f"{path} is over {MAX_JSON_BYTES >> 20} MiB; split the dataset")
    try:
        doc = json.loads(path.read_bytes())
    except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError included
        raise DataError(f"cannot read {path} as JSON ({exc}); {_COCO_LAYOUT}") from exc
    keys = ("images", "annotations", "categories")
    if not isinstance(doc, dict) or not all(isinstance(doc.get(k), list) for k in keys):
        raise DataError(f"{path} is not COCO JSON (it needs three lists); {_COCO_LAYOUT}")
    if not images_dir.is_dir():
        raise DataError(f"no such image folder: {images_dir} (for {path})")
    if not doc["images"] or len(doc["images"]) > MAX_IMAGES:
        raise DataError(f"{path} lists {len(doc['images'])} images; 1 to {MAX_IMAGES} are read")
    categories: dict[int, str] = {}
    for i, c in enumerate(doc["categories"]):
        cid = _get(c, "id", f"categories[{i}]", path)
        if cid in categories:
            raise DataError(f"{path}: category id {cid} appears twice")
        categories[cid] = _get(c, "name", f"categories[{i}]", path, str)
    if not categories:
        raise DataError(f"{path} has no categories; {_COCO_LAYOUT}")
    index = {cid: n for n, cid in enumerate(sorted(categories))}
    images: dict[int, dict[str, Any]] = {}
    for i, im in enumerate(doc["images"]):
        iid = _get(im, "id", f"images[{i}]", path)
        if iid in images:
            raise DataError(f"{path}: image id {iid} appears twice")
        name = _get(im, "file_name", f"images[{i}]", path, str)
        wh = (im.get("width"), im.get("height"))
        stored = wh if all(isinstance(v, int) and v > 0 for v in wh) else None
        images[iid] = {"name": name, "stored": stored, "boxes": [], "classes": []}
    crowd = 0
    for i, a in enumerate(doc["annotations"]):
        where = f"annotations[{i}]"
        iid, cid = _get(a, "image_id", where, path), _get(a, "category_id", where, path)
        if iid not in images:
            raise DataError(f"{path}: {where} refers to image id {iid}, which 'images' lacks")
        if cid not in index:
            known = ", ".join(map(str, sorted(index)))
            raise DataError(f"{path}: {where} has unknown category id {cid} (known: {known})")
        if a.get("iscrowd"):
            crowd += 1
            continue
        bbox, entry = a.get("bbox"), images[iid]
        if not (isinstance(bbox, list) and len(bbox) == 4) or not all(
            isinstance(v, int | float) and math.isfinite(v) for v in bbox
        ):
            raise DataError(f"{path}: {where}.bbox must be 4 numbers [x, y, w, h], got {bbox!r}")
        if len(entry["boxes"]) >= MAX_BOXES_PER_IMAGE:
            raise DataError(f"{path}: image {entry['name']!r} has {_TOO_MANY}")
        x, y, w, h = (float(v) for v in bbox)
        entry["boxes"].append((x, y, x + w, y + h))
        entry["classes"].append(index[cid])
    found = {iid: _coco_file(images_dir, im["name"]) for iid, im in images.items()}
    missing = [images[iid]["name"] for iid, p in found.items() if p is None]
    if missing:
        shown = ", ".join(repr(m) for m in missing[:5]) + (" ..." if len(missing) > 5 else "")
        raise DataError(f"{path}: {len(missing)} image(s) not found in {images_dir}: {shown}")
    for iid in sorted(images):
        entry, file = images[iid], found[iid]
        assert file is not None
        image = _read_image(file, entry["stored"])
        if entry["stored"] not in (None, image.shape[1::-1]):
            said = "x".join(map(str, entry["stored"]))
            raise DataError(f"{file} is {image.shape[1]}x{image.shape[0]}, {path} says {said}")
        out.add(file, entry["name"], image, entry["boxes"], entry["classes"])
    names = [categories[cid] for cid in sorted(categories)]
    return out.build(names, "coco", path, crowd_skipped=crowd, category_ids=tuple(sorted(index)))


def _yaml_scalar(text: str) -> str:
    quoted = re.match(r"""\s*("(?:[^"\\]|\\.)*"|'(?:[^']|'')*')""", text)
    if quoted is None:
        return text.split(" #", 1)[0].strip()
    q = quoted.group(1)
    return str(json.loads(q)) if q[0] == '"' else q[1:-1].replace("''", "'")


def _yaml_names(text: str) -> Any:
    """``names:`` of a data.yaml without PyYAML: a flow list, a block list or an id map."""
    found = re.search(r"^names[ \t]*:(.*(?:\n(?:[ \t-].*)?)*)", text, re.MULTILINE)
    body = found.group(1).strip() if found else ""
    if body.startswith("["):  # items split at commas outside quotes
        flow = re.findall(
            r"""'(?:[^']|'')*'|"(?:[^"\\]|\\.)*"|[^,\s][^,]*""", body[1 : body.rfind("]")]
        )
        return [_yaml_scalar(x) for x in flow]
    lines = [ln.strip() for ln in body.splitlines() if ln.strip()[:1] not in ("", "#")]
    if lines and all(ln.startswith("-") for ln in lines):
        return [_yaml_scalar(ln[1:]) for ln in lines]
    return {_yaml_scalar(k): _yaml_scalar(v) for k, v in (ln.split(":", 1) for ln in lines)}


def _yolo_names(root: Path) -> list[str]:
    for path in [p for p in (root / n for n in _YAML_NAMES) if p.is_file()][:1]:
        try:
            text = path.read_text(encoding="utf-8")
            try:
                import yaml

                doc = yaml.safe_load(text)
                names, nc = (doc.get("names"), doc.get("nc")) if isinstance(doc, dict) else (0, 0)
            except ImportError:
                names, nc = _yaml_names(text), None
        except Exception as exc:  # an unreadable file or YAML that does not parse
            raise DataError(f"cannot read {path} ({exc}); {_YOLO_LAYOUT}") from exc
        if isinstance(names, dict) and names:
            ids, order = {str(k): v for k, v in names.items()}, [str(i) for i in range(len(names))]
            if sorted(ids) != sorted(order):
                raise DataError(f"{path}: names ids must be 0..{len(ids) - 1}, got {list(ids)}")
            names = [ids[k] for k in order]
        if not isinstance(names, list) or not names:
            raise DataError(f"{path} has no 'names' list or mapping; {_YOLO_LAYOUT}")
        if isinstance(nc, int) and nc != len(names):
            raise DataError(f"{path}: nc is {nc} but names lists {len(names)} classes")
        return [str(n) for n in names]
    if not (path := root / "classes.txt").is_file():
        raise DataError(f"{root} has no data.yaml or classes.txt; {_YOLO_LAYOUT}")
    try:
        names = [n.strip() for n in path.read_text(encoding="utf-8").rstrip().splitlines()]
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {path} ({exc}); {_YOLO_LAYOUT}") from exc
    if not names or not all(names):
        raise DataError(f"{path} must list one class name a line, no blank lines")
    return names


def _yolo_images(root: Path) -> list[tuple[Path, Path]]:
    """(image, label file) for every visible file under a folder named ``images``."""
    found = []
    for p in root.rglob("*"):
        rel = p.relative_to(root).parts
        if p.is_file() and "images" in rel[:-1] and not any(x.startswith(".") for x in rel):
            i = len(rel) - 2 - rel[-2::-1].index("images")  # the last 'images' folder
            label = root.joinpath(*rel[:i], "labels", *rel[i + 1 :]).with_suffix(".txt")
            found.append((p, label))
    return sorted(found)


def _read_labels(path: Path, classes: int, w: int, h: int) -> tuple[np.ndarray, np.ndarray]:
    """Pixel xyxy boxes and class indices of one label file."""
    if path.stat().st_size > _MAX_LABEL_BYTES:
        raise DataError(f"{path} is over {_MAX_LABEL_BYTES >> 10} KiB; not a YOLO label file")
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise DataError(f"cannot read {path} ({exc}); {_YOLO_LAYOUT}") from exc
    boxes: list[np.ndarray] = []
    labels: list[int] = []
    for number, line in enumerate(lines, 1):
        if not (fields := line.split()):
            continue
        where = f"{path} line {number} ({line.strip()[:60]!r})"
        try:
            cls, coords = float(fields[0]), np.array([float(x) for x in fields[1:]])
        except ValueError:
            coords = np.full(1, np.nan)
        n = len(coords)
        if not (n == 4 or (n >= 6 and n % 2 == 0)) or not np.isfinite(coords).all():
            raise DataError(f"{where} is not 'class cx cy w h' (or a polygon); {_YOLO_LAYOUT}")
        if not (cls.is_integer() and 0 <= cls < classes):
            raise DataError(f"{where}: class {fields[0]} is not a class index 0..{classes - 1}")
        if coords.min() < -_COORD_SLACK or coords.max() > 1 + _COORD_SLACK:
            raise DataError(f"{where}: coordinates must be normalised to 0..1, not pixels")
        if len(boxes) >= MAX_BOXES_PER_IMAGE:
            raise DataError(f"{path} has {_TOO_MANY}")
        if n == 4:
            cx, cy, bw, bh = coords
            box = (cx - bw / 2, cy - bh / 2, cx + bw / 2, cy + bh / 2)
        else:  # a segmentation polygon: its bounding box
            xs, ys = coords[0::2], coords[1::2]
            box = (xs.min(), ys.min(), xs.max(), ys.max())
        boxes.append(np.array(box) * [w, h, w, h])
        labels.append(int(cls))
    return np.array(boxes, dtype=np.float64).reshape(-1, 4), np.array(labels, dtype=np.int64)


def load_yolo(root: Path, *, size: int | None = None) -> DetectionSet:
    """An Ultralytics-layout folder as a DetectionSet; see the module docstring."""
    root = Path(root).expanduser()
    out = _Assembly(size)
    if not root.is_dir():
        raise DataError(f"no such folder: {root}; {_YOLO_LAYOUT}")
    names, images = _yolo_names(root), _yolo_images(root)
    if len(images) > MAX_IMAGES:
        raise DataError(f"{root} holds {len(images)} images; at most {MAX_IMAGES} are read")
    labelled = set()
    for image_path, label_file in images:
        image = _read_image(image_path)
        boxes, classes = np.zeros((0, 4)), np.zeros(0, dtype=np.int64)
        if label_file.is_file():
            labelled.add(label_file)
            boxes, classes = _read_labels(label_file, len(names), image.shape[1], image.shape[0])
        out.add(image_path, image_path.relative_to(root).as_posix(), image, boxes, classes)
    orphans = sum(1 for p in root.rglob("labels/**/*.txt") if p not in labelled)
    unlabelled = len(images) - len(labelled)
    return out.build(names, "yolo", root, unlabelled_images=unlabelled, orphan_labels=orphans)


def _coco_files(folder: Path) -> list[Path]:
    """JSON files directly in ``folder`` or its ``annotations/`` that look like COCO."""
    found = []
    for candidate in sorted([*folder.glob("*.json"), *folder.glob("annotations/*.json")]):
        try:
            with candidate.open("rb") as handle:
                head = handle.read(1 << 16)
        except OSError:
            continue
        keys = (b'"images"', b'"annotations"', b'"categories"')
        if head.lstrip().startswith(b"{") and any(k in head for k in keys):
            found.append(candidate)
    return found


def load_detection_folder(path: Path | str, size: int | None = None) -> DetectionSet:
    """A YOLO folder (``data.yaml``, ``classes.txt``, or ``images/`` with ``labels/``) or a
    COCO one (one COCO JSON file, or in ``annotations/``; images in ``images/`` or beside
    it); a COCO ``.json`` path is read with its images found the same way."""
    path = Path(path).expanduser()
    accepted = f"accepted layouts: COCO ({_COCO_LAYOUT}) or YOLO ({_YOLO_LAYOUT})"
    if path.is_file() and path.suffix.lower() == ".json":
        folder = path.parent.parent if path.parent.name == "annotations" else path.parent
        images = folder / "images"
        return load_coco(path, images if images.is_dir() else folder, size=size)
    if not path.is_dir():
        raise DataError(f"no such folder: {path}; {accepted}")
    yolo = any((path / n).is_file() for n in [*_YAML_NAMES, "classes.txt"]) or (
        (path / "images").is_dir() and (path / "labels").is_dir()
    )
    cocos = _coco_files(path)
    if yolo and cocos:
        both = f"{path} holds both a YOLO dataset and COCO JSON ({cocos[0].name})"
        raise DataError(f"{both}; call load_yolo or load_coco for the one you mean")
    if yolo:
        return load_yolo(path, size=size)
    if len(cocos) > 1:
        listed = ", ".join(p.relative_to(path).as_posix() for p in cocos[:5])
        raise DataError(f"{path} holds several COCO JSON files ({listed}); give the one to load")
    if cocos:
        return load_detection_folder(cocos[0], size)
    raise DataError(f"{path} holds neither a COCO nor a YOLO detection dataset; {accepted}")


def predictions_from_fractions(rows: Sequence[Any], frame_size: int) -> list[list[Prediction]]:
    """Per-frame detector rows (x1, y1, x2, y2 as fractions, score, class: as in
    ``shared.tasks.detection``) as pixel predictions, padding rows (score 0) left out."""
    frames = [np.asarray(f, dtype=np.float64).reshape(-1, 6) for f in rows]
    return [[(tuple(r[:4] * frame_size), r[4], int(r[5])) for r in f if r[4] > 0] for f in frames]


def _predictions(ds: DetectionSet, predictions: Sequence[Sequence[Prediction]] | None) -> Any:
    """Predictions checked against the dataset, boxes clipped, empty boxes left out."""
    if predictions is None:
        return None
    if len(predictions) != len(ds):
        raise DataError(f"predictions has {len(predictions)} frames; the dataset has {len(ds)}")
    out: list[list[tuple[np.ndarray, float, int]]] = [[] for _ in predictions]
    for i, frame in enumerate(predictions):
        for box, score, cls in frame:
            b = np.asarray(box, dtype=np.float64)
            if b.shape != (4,) or not np.isfinite(b).all() or not math.isfinite(score):
                raise DataError(f"frame {i}: a prediction needs 4 finite corners and a score")
            if not 0 <= int(cls) < ds.num_classes:
                raise DataError(f"frame {i}: predicted class {cls} outside 0..{ds.num_classes - 1}")
            clipped, keep = _clean_boxes(b, ds.frame_size, ds.frame_size)
            if keep[0]:
                out[i].append((clipped[0], float(score), int(cls)))
    return out


def _write_images(ds: DetectionSet, out_dir: Path) -> tuple[Path, ...]:
    """The frames as lossless PNG files, ``OUT/images/000000.png`` on."""
    (out_dir / "images").mkdir(parents=True, exist_ok=True)
    paths = tuple(out_dir / "images" / f"{i:06d}.png" for i in range(len(ds)))
    for frame, path in zip(ds.frames, paths, strict=True):
        Image.fromarray(frame).save(path)
    return paths


def _xywh(box: np.ndarray) -> list[float]:
    x1, y1, x2, y2 = (float(v) for v in box)
    return [round(x1, 3), round(y1, 3), round(x2 - x1, 3), round(y2 - y1, 3)]


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def _frame_boxes(ds: DetectionSet, i: int) -> tuple[np.ndarray, np.ndarray]:
    """Frame ``i``'s boxes clipped to the frame, those without area left out."""
    boxes, keep = _clean_boxes(ds.boxes[i], ds.frame_size, ds.frame_size)
    return boxes[keep], ds.classes[i][keep]


def write_coco(
    ds: DetectionSet,
    out_dir: Path,
    *,
    predictions: Sequence[Sequence[Prediction]] | None = None,
) -> WrittenDataset:
    """``OUT/images/`` and ``OUT/annotations.json``; with ``predictions`` (per frame,
    pixel boxes) also ``OUT/predictions.json`` in COCO's results format."""
    out_dir, preds = Path(out_dir), _predictions(ds, predictions)
    files, s = _write_images(ds, out_dir), ds.frame_size
    annotations: list[dict[str, Any]] = []
    for i in range(len(ds)):
        for box, cls in zip(*_frame_boxes(ds, i), strict=True):
            x, y, w, h = _xywh(box)
            polygon = [x, y, x + w, y, x + w, y + h, x, y + h]
            k = len(annotations) + 1
            ann: dict[str, Any] = dict(id=k, image_id=i + 1, category_id=int(cls) + 1)
            ann.update(bbox=[x, y, w, h], area=round(w * h, 3), segmentation=[polygon], iscrowd=0)
            annotations.append(ann)
    doc = {
        "info": {"description": f"EdgeLoop detection dataset {ds.identity}", "version": "1"},
        "licenses": [{"id": 0, "name": "unspecified", "url": ""}],
        "images": [
            {"id": i + 1, "file_name": f.name, "width": s, "height": s, "license": 0}
            for i, f in enumerate(files)
        ],
        "categories": [
            {"id": c + 1, "name": name, "supercategory": "none"}
            for c, name in enumerate(ds.class_names)
        ],
        "annotations": annotations,
    }
    _write_json(out_dir / "annotations.json", doc)
    if preds is None:
        return WrittenDataset(out_dir, out_dir / "annotations.json", files)
    results = [
        {"image_id": i + 1, "category_id": c + 1, "bbox": _xywh(b), "score": round(score, 6)}
        for i, frame in enumerate(preds)
        for b, score, c in frame
    ]
    _write_json(pred_path := out_dir / "predictions.json", results)
    return WrittenDataset(out_dir, out_dir / "annotations.json", files, pred_path)


def write_yolo(ds: DetectionSet, out_dir: Path) -> WrittenDataset:
    """``OUT/images/``, ``OUT/labels/`` (an empty file for a frame with no objects),
    ``OUT/classes.txt`` and ``OUT/data.yaml``."""
    out_dir = Path(out_dir)
    files, s = _write_images(ds, out_dir), float(ds.frame_size)
    (out_dir / "labels").mkdir(parents=True, exist_ok=True)
    for i, f in enumerate(files):
        lines = [
            f"{int(c)} {(x1 + x2) / 2 / s:.6f} {(y1 + y2) / 2 / s:.6f}"
            f" {(x2 - x1) / s:.6f} {(y2 - y1) / s:.6f}\n"
            for (x1, y1, x2, y2), c in zip(*_frame_boxes(ds, i), strict=True)
        ]
        (out_dir / "labels" / f"{f.stem}.txt").write_text("".join(lines), encoding="utf-8")
    names = "".join(f"{n}\n" for n in ds.class_names)
    (out_dir / "classes.txt").write_text(names, encoding="utf-8")
    # JSON strings are YAML double-quoted scalars: any class name stays one name.
    yaml = ["path: .", "train: images", "val: images", f"nc: {ds.num_classes}", "names:"]
    yaml += [f"  {i}: {json.dumps(name)}" for i, name in enumerate(ds.class_names)]
    (out_dir / "data.yaml").write_text("\n".join(yaml) + "\n", encoding="utf-8")
    return WrittenDataset(out_dir, out_dir / "data.yaml", files)


def _rectangles(
    regions: Sequence[tuple[np.ndarray, float | None, int]], ds: DetectionSet, prefix: str
) -> list[dict[str, Any]]:
    """Label Studio rectanglelabels results (percent of the frame); a score when given."""
    out = []
    for j, (box, score, cls) in enumerate(regions):
        x1, y1, x2, y2 = (float(v) * 100.0 / ds.frame_size for v in box)
        xywh = dict(x=x1, y=y1, width=x2 - x1, height=y2 - y1, rotation=0.0)
        value: dict[str, Any] = {k: round(v, 4) for k, v in xywh.items()}
        region: dict[str, Any] = dict(id=f"{prefix}{j}", from_name="label", to_name="image")
        region.update(type="rectanglelabels", original_width=ds.frame_size, image_rotation=0)
        region.update(original_height=ds.frame_size, value=value)
        value["rectanglelabels"] = [ds.class_names[int(cls)]]
        if score is not None:
            region["score"] = round(score, 6)
        out.append(region)
    return out


def write_labelstudio(
    ds: DetectionSet,
    out_dir: Path,
    *,
    predictions: Sequence[Sequence[Prediction]] | None = None,
    model_version: str | None = None,
    image_prefix: str = "",
    include_annotations: bool = True,
) -> WrittenDataset:
    """``OUT/images/``, ``OUT/tasks.json``, ``OUT/labeling_config.xml``. A task's image is
    ``image_prefix + "images/<file>"`` (e.g. ``/data/local-files/?d=<folder>/``); its
    boxes its annotation (none with ``include_annotations=False``, for pre-labelling),
    its predictions one prediction scored by the mean box score (1.0 with no box)."""
    out_dir, preds = Path(out_dir), _predictions(ds, predictions)
    files = _write_images(ds, out_dir)
    tasks = []
    for i, f in enumerate(files):
        task: dict[str, Any] = {"data": {"image": f"{image_prefix}images/{f.name}"}}
        if include_annotations:
            truth = [(b, None, int(c)) for b, c in zip(*_frame_boxes(ds, i), strict=True)]
            result = _rectangles(truth, ds, f"gt{i}_")
            task["annotations"] = [dict(result=result, ground_truth=False, was_cancelled=False)]
        if preds is not None:
            scores = [score for _, score, _ in preds[i]]
            score = round(float(np.mean(scores)), 6) if scores else 1.0
            result = _rectangles(preds[i], ds, f"p{i}_")
            version = model_version or "edgeloop"
            task["predictions"] = [dict(model_version=version, score=score, result=result)]
        tasks.append(task)
    _write_json(out_dir / "tasks.json", tasks)
    labels = "".join(f"    <Label value={quoteattr(n)}/>\n" for n in ds.class_names)
    config = '<View>\n  <Image name="image" value="$image"/>\n'
    config += f'  <RectangleLabels name="label" toName="image">\n{labels}  </RectangleLabels>\n'
    (out_dir / "labeling_config.xml").write_text(config + "</View>\n", encoding="utf-8")
    return WrittenDataset(out_dir, out_dir / "tasks.json", files)
