"""Review results as datasets in standard formats: CSV, JSON, ImageFolder, COCO, YOLO, Label Studio.

One row per sample (``ExportRow``); its label is the best one known: the newest
human label, else the teacher's (verified and flagged samples), else none (pending
and discarded samples). Row-per-sample formats (CSV, JSON, Label Studio) list every
row; dataset formats (ImageFolder, COCO, YOLO) hold the labelled rows only.

- ``csv``, ``json``: one record per sample (``COLUMNS``). CSV cells that a
  spreadsheet would read as a formula (starting with ``= + - @``, tab or CR) get a
  leading ``'``.
- ``imagefolder`` (alias ``zip``): a zip with one folder per class name holding the
  images, and ``labels.csv``.
- ``coco``: a COCO JSON file (``info``, ``licenses``, ``images``, ``categories``,
  ``annotations``); one annotation per labelled image whose ``bbox`` is the whole
  frame (this is classification). ``file_name`` is ``<class folder>/<sample id>.<ext>``,
  the layout of the ImageFolder export, so the file resolves its images when put at
  the root of that export unzipped; ``coco_url`` is the image on the REST API.
  Category ids start at 1, in the order of the models' class lists.
- ``yolo``: a zip in Ultralytics' layout: ``images/<id>.<ext>``, ``labels/<id>.txt``
  (``<class> 0.5 0.5 1.0 1.0``: the whole frame, normalised centre and size),
  ``classes.txt`` (one name a line, line number = class id) and ``data.yaml``.
A detector's samples (``ExportRow.boxes``) export their boxes instead: a COCO
annotation per box (pixels; ``file_name`` ``images/<sample id>.<ext>``), a YOLO line
per box (``<class> <cx> <cy> <w> <h>``, normalised; an empty file for an empty
frame), Label Studio ``rectanglelabels`` results (percent of the frame) for the edge's
and the teacher's boxes as predictions and a human's as the annotation, and the
boxes in pixels with class names in the JSON records.

- ``labelstudio``: Label Studio tasks (JSON list) for an image classification
  project with this labeling config::

      <View>
        <Image name="image" value="$image"/>
        <Choices name="label" toName="image" choice="single">...</Choices>
      </View>

  ``data.image`` is the image's URL on the REST API; the edge and teacher outputs are
  ``predictions`` (``model_version`` ``<model name>:<version>``, ``score`` = the top
  class's probability, ``result`` in the choices format); a human label is the
  task's one entry of ``annotations``.
"""

from __future__ import annotations

import csv
import io
import json
import tempfile
import zipfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import IO, Any

from starlette.responses import StreamingResponse

from cloud_service.blobs import BlobStore
from shared.errors import ContractError, EdgeLoopError
from shared.tasks import CLASSIFICATION

__all__ = [
    "COLUMNS",
    "FORMATS",
    "ExportRow",
    "coco",
    "csv_cell",
    "download",
    "folder_name",
    "label_studio",
    "media_type",
    "write_export",
]

FORMATS = CLASSIFICATION.export_formats  # what the task can write (shared.tasks)
COLUMNS = [
    "sample_id", "label", "class_name", "source", "labeled_by", "status", "agent_id", "fleet",
    "captured_at", "model_name", "model_version", "edge_label", "edge_class",
    "edge_confidence", "teacher_label", "teacher_class", "teacher_confidence",
    "teacher_version", "route_reason",
]  # fmt: skip
_FORMULA_START = ("=", "+", "-", "@", "\t", "\r")
_CHOICES_FROM, _CHOICES_TO = "label", "image"


@dataclass(frozen=True)
class ExportRow:
    """One sample as the exports write it; ``label`` None: no label known."""

    sample_id: str
    label: int | None
    class_name: str | None
    source: str | None  # "human", "teacher" or None
    labeled_by: str | None
    labeled_at: datetime | None
    status: str
    agent_id: str
    fleet: str
    captured_at: datetime
    model_name: str
    model_version: str
    classes: tuple[str, ...]
    edge_label: int
    edge_confidence: float
    teacher_label: int | None
    teacher_confidence: float | None
    teacher_model: str | None
    teacher_version: str | None
    route_reason: str
    image_key: str
    image_format: str
    image_width: int
    image_height: int
    # A detector's sample (shared.tasks.detection): the chosen label's boxes, the
    # edge's and the teacher's, each ``x1, y1, x2, y2, score, class`` with the corners
    # as fractions of the frame; None on a classifier's sample.
    boxes: tuple[tuple[float, ...], ...] | None = None
    edge_boxes: tuple[tuple[float, ...], ...] | None = None
    teacher_boxes: tuple[tuple[float, ...], ...] | None = None

    @property
    def detection(self) -> bool:
        return self.edge_boxes is not None

    def record(self) -> dict[str, Any]:
        """The CSV / JSON record (``COLUMNS``)."""
        values = asdict(self)
        values["captured_at"] = self.captured_at.isoformat()
        values["edge_class"] = self._name(self.edge_label)
        values["teacher_class"] = self._name(self.teacher_label)
        values["edge_confidence"] = round(self.edge_confidence, 6)
        if self.teacher_confidence is not None:
            values["teacher_confidence"] = round(self.teacher_confidence, 6)
        return {k: values[k] for k in COLUMNS}

    def _name(self, index: int | None) -> str | None:
        if index is None:
            return None
        return self.classes[index] if 0 <= index < len(self.classes) else str(index)

    @property
    def image_name(self) -> str:
        ext = "jpg" if self.image_format == "jpeg" else self.image_format
        return f"{self.sample_id}.{ext}"


def csv_cell(value: Any) -> Any:
    """A value safe in a spreadsheet: text that would start a formula gets a leading '."""
    if isinstance(value, str) and value.startswith(_FORMULA_START):
        return "'" + value
    return value


def media_type(fmt: str) -> tuple[str, str]:
    """The media type and file extension of a format."""
    _check(fmt)
    if fmt == "csv":
        return "text/csv", "csv"
    if fmt in ("json", "coco", "labelstudio"):
        return "application/json", "json"
    return "application/zip", "zip"


def write_export(
    fmt: str,
    rows: Sequence[ExportRow],
    out: IO[bytes],
    *,
    blobs: BlobStore,
    image_url: Callable[[str], str],
) -> None:
    """Write ``rows`` as ``fmt`` to ``out``; ``image_url(sample_id)`` is an image's URL."""
    _check(fmt)
    if fmt == "csv":
        out.write(_csv(rows).encode())
    elif fmt == "json":
        records = [
            {**r.record(), "boxes": _named_boxes(r, r.boxes)} if r.detection else r.record()
            for r in rows
        ]
        out.write(json.dumps(records, indent=1).encode())
    elif fmt in ("imagefolder", "zip"):
        _image_folder(rows, out, blobs)
    elif fmt == "coco":
        out.write(json.dumps(coco(rows, image_url=image_url)).encode())
    elif fmt == "yolo":
        _yolo(rows, out, blobs)
    else:
        out.write(json.dumps(label_studio(rows, image_url=image_url), indent=1).encode())


_SPOOL_MAX = 32 * 1024 * 1024  # larger exports go to a temporary file, not memory
_CHUNK = 1024 * 1024


def download(
    fmt: str, rows: Sequence[ExportRow], *, blobs: BlobStore, base_url: str
) -> StreamingResponse:
    """An HTTP download of ``rows`` as ``fmt``; images link to the REST API at ``base_url``."""
    kind, ext = media_type(fmt)
    root = base_url.rstrip("/")
    out = tempfile.SpooledTemporaryFile(max_size=_SPOOL_MAX)  # noqa: SIM115 (closed by chunks)
    try:
        write_export(
            fmt, rows, out, blobs=blobs, image_url=lambda i: f"{root}/v1/samples/{i}/image"
        )
        size = out.tell()
        out.seek(0)
    except BaseException:
        out.close()
        raise
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    name = f"edgeloop-{fmt}-{stamp}.{ext}"
    return StreamingResponse(
        _chunks(out),
        media_type=kind,
        headers={
            "Content-Disposition": f'attachment; filename="{name}"',
            "Content-Length": str(size),
        },
    )


def _chunks(out: IO[bytes]) -> Iterator[bytes]:
    try:
        while chunk := out.read(_CHUNK):
            yield chunk
    finally:
        out.close()


def _check(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ContractError(
            f"export format {fmt!r} is not one of {', '.join(FORMATS)}", reason="invalid_format"
        )


def _csv(rows: Iterable[ExportRow]) -> str:
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=COLUMNS)
    writer.writeheader()
    for row in rows:
        writer.writerow({k: csv_cell(v) for k, v in row.record().items()})
    return text.getvalue()


def _labelled(rows: Iterable[ExportRow]) -> list[ExportRow]:
    """Rows with a label: a class, or a detector's boxes (none at all is a label too)."""
    return [
        r
        for r in rows
        if (r.boxes is not None if r.detection else r.label is not None and r.class_name)
    ]


def _named_boxes(
    row: ExportRow, boxes: tuple[tuple[float, ...], ...] | None
) -> list[dict[str, Any]] | None:
    """Boxes in pixels with their class names, for the JSON record."""
    if boxes is None:
        return None
    return [
        {
            "bbox_xyxy": _pixels(row, box),
            "score": round(box[4], 6) if len(box) > 5 else None,
            "class": int(box[-1]),
            "class_name": row._name(int(box[-1])),
        }
        for box in boxes
    ]


def _pixels(row: ExportRow, box: Sequence[float]) -> list[float]:
    w, h = row.image_width, row.image_height
    return [round(box[0] * w, 2), round(box[1] * h, 2), round(box[2] * w, 2), round(box[3] * h, 2)]


def _class_list(rows: Iterable[ExportRow]) -> list[str]:
    """Every class name of the rows' models, in the models' order, each once."""
    names: dict[str, None] = {}
    for row in rows:
        names.update(dict.fromkeys(row.classes))
        if row.detection:
            for box in row.boxes or ():
                names.setdefault(row._name(int(box[-1])) or "")
        elif row.class_name is not None:
            names.setdefault(row.class_name)
    return list(names)


def folder_name(name: str) -> str:
    """A class name as a safe folder name (no separators, no dot-only names)."""
    cleaned = "".join(c if c.isalnum() or c in "-_. " else "_" for c in name).strip(". ")
    return cleaned or "_"


def _image(blobs: BlobStore, row: ExportRow) -> bytes | None:
    try:
        return blobs.get(row.image_key)
    except EdgeLoopError:
        return None  # a blob removed by retention: the row stays in the listing


def _image_folder(rows: Sequence[ExportRow], out: IO[bytes], blobs: BlobStore) -> None:
    # Images are JPEG/PNG already: storing them beats deflating them again.
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for row in _labelled(rows):
            data = _image(blobs, row)
            if data is not None:
                archive.writestr(f"{folder_name(row.class_name or '')}/{row.image_name}", data)
        archive.writestr("labels.csv", _csv(rows), compress_type=zipfile.ZIP_DEFLATED)


def coco(rows: Sequence[ExportRow], *, image_url: Callable[[str], str]) -> dict[str, Any]:
    """A COCO dataset dict of the labelled rows (whole-frame boxes)."""
    labelled = _labelled(rows)
    names = _class_list(labelled)
    category = {name: i + 1 for i, name in enumerate(names)}
    newest = max((r.captured_at for r in labelled), default=None)
    images: list[dict[str, Any]] = []
    annotations: list[dict[str, Any]] = []
    for i, row in enumerate(labelled, start=1):
        w, h = row.image_width, row.image_height
        folder = "images" if row.detection else folder_name(row.class_name or "")
        images.append(
            {
                "id": i,
                "file_name": f"{folder}/{row.image_name}",
                "width": w,
                "height": h,
                "date_captured": row.captured_at.isoformat(),
                "coco_url": image_url(row.sample_id),
                "license": 0,
                "sample_id": row.sample_id,
            }
        )
        if row.detection:
            for box in row.boxes or ():
                x1, y1, x2, y2 = _pixels(row, box)
                annotations.append(
                    {
                        "id": len(annotations) + 1,
                        "image_id": i,
                        "category_id": category[row._name(int(box[-1])) or ""],
                        "bbox": [x1, y1, round(x2 - x1, 2), round(y2 - y1, 2)],
                        "area": round((x2 - x1) * (y2 - y1), 2),
                        "iscrowd": 0,
                        "source": row.source,
                        "labeled_by": row.labeled_by,
                    }
                )
            continue
        annotations.append(
            {
                "id": len(annotations) + 1,
                "image_id": i,
                "category_id": category[row.class_name or ""],
                "bbox": [0, 0, w, h],
                "area": w * h,
                "segmentation": [[0, 0, w, 0, w, h, 0, h]],
                "iscrowd": 0,
                "source": row.source,
                "labeled_by": row.labeled_by,
            }
        )
    return {
        "info": {
            "description": (
                "EdgeLoop review results (detection: the chosen boxes)"
                if any(r.detection for r in labelled)
                else "EdgeLoop review results (classification: whole-frame boxes)"
            ),
            "version": "1",
            "date_created": newest.isoformat() if newest else None,
        },
        "licenses": [{"id": 0, "name": "unspecified", "url": ""}],
        "images": images,
        "categories": [
            {"id": category[name], "name": name, "supercategory": "none"} for name in names
        ],
        "annotations": annotations,
    }


def _yolo(rows: Sequence[ExportRow], out: IO[bytes], blobs: BlobStore) -> None:
    labelled = _labelled(rows)
    names = _class_list(labelled)
    index = {name: i for i, name in enumerate(names)}
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for row in labelled:
            data = _image(blobs, row)
            if data is None:
                continue
            archive.writestr(f"images/{row.image_name}", data)
            stem = row.image_name.rsplit(".", 1)[0]
            if row.detection:
                lines = [
                    f"{index[row._name(int(b[-1])) or '']} {(b[0] + b[2]) / 2:.6f}"
                    f" {(b[1] + b[3]) / 2:.6f} {b[2] - b[0]:.6f} {b[3] - b[1]:.6f}\n"
                    for b in row.boxes or ()
                ]
                archive.writestr(f"labels/{stem}.txt", "".join(lines))
                continue
            archive.writestr(
                f"labels/{stem}.txt", f"{index[row.class_name or '']} 0.5 0.5 1.0 1.0\n"
            )
        archive.writestr("classes.txt", "".join(f"{name}\n" for name in names))
        # JSON strings are YAML double-quoted scalars: any class name stays one name.
        yaml = ["path: .", "train: images", "val: images", f"nc: {len(names)}", "names:"]
        yaml += [f"  {i}: {json.dumps(name)}" for i, name in enumerate(names)]
        archive.writestr("data.yaml", "\n".join(yaml) + "\n")


def _choice(name: str) -> list[dict[str, Any]]:
    return [
        {
            "from_name": _CHOICES_FROM,
            "to_name": _CHOICES_TO,
            "type": "choices",
            "value": {"choices": [name]},
        }
    ]


def _rectangles(row: ExportRow, boxes: Sequence[Sequence[float]]) -> list[dict[str, Any]]:
    """Boxes as Label Studio ``rectanglelabels`` results (percent of the frame)."""
    return [
        {
            "from_name": _CHOICES_FROM,
            "to_name": _CHOICES_TO,
            "type": "rectanglelabels",
            "original_width": row.image_width,
            "original_height": row.image_height,
            "image_rotation": 0,
            "value": {
                "x": round(100 * b[0], 4),
                "y": round(100 * b[1], 4),
                "width": round(100 * (b[2] - b[0]), 4),
                "height": round(100 * (b[3] - b[1]), 4),
                "rotation": 0,
                "rectanglelabels": [row._name(int(b[-1])) or ""],
            },
            **({"score": round(b[4], 6)} if len(b) > 5 else {}),
        }
        for b in boxes
    ]


def _mean_score(boxes: Sequence[Sequence[float]]) -> float:
    scores = [b[4] for b in boxes if len(b) > 5]
    return round(sum(scores) / len(scores), 6) if scores else 1.0


def label_studio(
    rows: Sequence[ExportRow], *, image_url: Callable[[str], str]
) -> list[dict[str, Any]]:
    """Label Studio tasks: edge and teacher outputs as predictions, a human label as annotation."""
    tasks = []
    for row in rows:
        if row.detection:
            tasks.append(_label_studio_boxes(row, image_url))
            continue
        predictions = [
            {
                "model_version": f"{row.model_name}:{row.model_version}",
                "score": round(row.edge_confidence, 6),
                "result": _choice(row._name(row.edge_label) or ""),
            }
        ]
        if row.teacher_label is not None and row.teacher_confidence is not None:
            predictions.append(
                {
                    "model_version": f"{row.teacher_model}:{row.teacher_version}",
                    "score": round(row.teacher_confidence, 6),
                    "result": _choice(row._name(row.teacher_label) or ""),
                }
            )
        annotations = []
        if row.source == "human" and row.class_name is not None:
            annotations.append(
                {
                    "result": _choice(row.class_name),
                    "created_at": row.labeled_at.isoformat() if row.labeled_at else None,
                    "ground_truth": False,
                    "was_cancelled": False,
                }
            )
        tasks.append(
            {
                "data": _task_data(row, image_url),
                "predictions": predictions,
                "annotations": annotations,
            }
        )
    return tasks


def _label_studio_boxes(row: ExportRow, image_url: Callable[[str], str]) -> dict[str, Any]:
    """A detector's sample as a Label Studio task of a ``RectangleLabels`` project."""
    predictions = [
        {
            "model_version": version,
            "score": _mean_score(boxes),
            "result": _rectangles(row, boxes),
        }
        for version, boxes in (
            (f"{row.model_name}:{row.model_version}", row.edge_boxes),
            (f"{row.teacher_model}:{row.teacher_version}", row.teacher_boxes),
        )
        if boxes is not None
    ]
    annotations = []
    if row.source == "human" and row.boxes is not None:
        annotations.append(
            {
                "result": _rectangles(row, row.boxes),
                "created_at": row.labeled_at.isoformat() if row.labeled_at else None,
                "ground_truth": False,
                "was_cancelled": False,
            }
        )
    return {
        "data": _task_data(row, image_url),
        "predictions": predictions,
        "annotations": annotations,
    }


def _task_data(row: ExportRow, image_url: Callable[[str], str]) -> dict[str, Any]:
    """A Label Studio task's ``data``: the image's URL and where the sample came from."""
    return {
        "image": image_url(row.sample_id),
        "sample_id": row.sample_id,
        "agent_id": row.agent_id,
        "fleet": row.fleet,
        "captured_at": row.captured_at.isoformat(),
        "status": row.status,
        "labeled_by": row.labeled_by if row.source == "human" else None,
    }
