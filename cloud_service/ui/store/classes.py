"""Class names for the review UI: from registered manifests, the fleet's model, the teacher."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from cloud_service.db.models import FleetModel, ModelVersion, Sample
from shared.errors import ContractError

if TYPE_CHECKING:
    from cloud_service.web.state import ApiState

__all__ = ["ClassNames", "class_names_for", "model_file_labels"]

log = logging.getLogger(__name__)


def _index_names(n: int) -> list[str]:
    return [str(i) for i in range(n)]


_FILE_LABELS: dict[tuple[str, int, int], tuple[str, ...]] = {}
_FILE_LABELS_LOCK = threading.Lock()


def model_file_labels(path: Path) -> tuple[str, ...]:
    """The class names in an ONNX file's ``edgeloop.labels`` metadata (cached), else ().

    Reads the metadata only (no inference session): the UI uses the teacher's
    names for samples whose model the registry does not know.
    """
    try:
        stat = path.stat()
    except OSError:
        return ()
    key = (str(path), stat.st_mtime_ns, stat.st_size)
    with _FILE_LABELS_LOCK:
        if key in _FILE_LABELS:
            return _FILE_LABELS[key]
    labels: tuple[str, ...] = ()
    try:
        import onnx

        model = onnx.load(str(path), load_external_data=False)
        meta = {p.key: p.value for p in model.metadata_props}
        parsed = json.loads(meta.get("edgeloop.labels", "null"))
        if isinstance(parsed, list):
            labels = tuple(str(x) for x in parsed)
    except Exception as exc:  # a broken or foreign file: no names, the UI shows indices
        log.warning("no class names from %s: %s", path, exc)
    with _FILE_LABELS_LOCK:
        _FILE_LABELS[key] = labels
    return labels


class ClassNames:
    """The class names of the fleet's models, looked up once per request.

    For a sample's model (name, version, class count) the names come from, in order:
    the registered version's manifest; the version its fleet serves; the newest
    registered version of the same model name; ``fallback`` (the teacher's names);
    each only when its count matches. Indices "0".."n-1" when none is known.
    """

    def __init__(self, session: Session, *, fallback: Sequence[str] = ()) -> None:
        self._session = session
        self._fallback = list(fallback) if _named(fallback) else []
        self._versions: dict[str, list[tuple[str, list[str]]]] = {}
        self._fleets: dict[str, tuple[str, str] | None] = {}
        self._memo: dict[tuple[str, str, str, int], list[str]] = {}
        self._pairs: list[tuple[str, str, list[str]]] | None = None

    def _registered(self, model_name: str) -> list[tuple[str, list[str]]]:
        if model_name not in self._versions:
            rows = self._session.execute(
                select(ModelVersion.version, ModelVersion.manifest)
                .where(ModelVersion.name == model_name)
                .order_by(ModelVersion.id.desc())
            ).all()
            found = []
            for version, manifest in rows:
                labels = manifest.get("labels") if isinstance(manifest, dict) else None
                if isinstance(labels, list):
                    found.append((version, [str(x) for x in labels]))
            self._versions[model_name] = found
        return self._versions[model_name]

    def _serving(self, fleet: str) -> tuple[str, str] | None:
        if fleet not in self._fleets:
            record = self._session.get(FleetModel, fleet) if fleet else None
            self._fleets[fleet] = (record.model_name, record.version) if record else None
        return self._fleets[fleet]

    def of(
        self,
        model_name: str,
        model_version: str,
        n: int,
        *,
        fleet: str = "",
        at_least: bool = False,
    ) -> list[str]:
        """The names of the classes 0..n-1 of this model version (``at_least``: a list
        that covers them, for a detector, whose answers do not say how many it has)."""
        key = (model_name, model_version, fleet, -n if at_least else n)
        if key in self._memo:
            return self._memo[key]
        candidates: list[list[str]] = []
        registered = self._registered(model_name)
        candidates += [labels for version, labels in registered if version == model_version]
        serving = self._serving(fleet)
        if serving is not None:
            candidates += [
                labels for version, labels in self._registered(serving[0]) if version == serving[1]
            ]
        candidates += [labels for _, labels in registered]
        candidates.append(self._fallback)
        fits = (lambda c: len(c) >= max(n, 1)) if at_least else (lambda c: len(c) == n)
        names = next((c for c in candidates if fits(c)), None) or _index_names(n)
        self._memo[key] = names
        return names

    def for_sample(self, sample: Sample) -> list[str]:
        if sample.edge_boxes is not None:  # a detector's: its scores are per box
            used = max((int(b[-1]) for b in sample.edge_boxes), default=-1) + 1
            return self.of(
                sample.model_name, sample.model_version, used, fleet=sample.fleet, at_least=True
            )
        return self.of(
            sample.model_name, sample.model_version, len(sample.edge_scores), fleet=sample.fleet
        )

    def _stored_models(self) -> list[tuple[str, str, list[str]]]:
        """Each (model name, version) that samples carry, with its class names."""
        if self._pairs is None:
            firsts = self._session.execute(
                select(func.min(Sample.sample_id)).group_by(Sample.model_name, Sample.model_version)
            ).scalars()
            ids = list(firsts)
            pairs = []
            for sample in self._session.scalars(select(Sample).where(Sample.sample_id.in_(ids))):
                pairs.append((sample.model_name, sample.model_version, self.for_sample(sample)))
            self._pairs = pairs
        return self._pairs

    def known(self) -> list[str]:
        """Every class name the registered models and the teacher have (form suggestions)."""
        names: dict[str, None] = {}
        for (manifest,) in self._session.execute(select(ModelVersion.manifest).limit(1000)):
            labels = manifest.get("labels") if isinstance(manifest, dict) else None
            if isinstance(labels, list) and _named([str(x) for x in labels]):
                names.update(dict.fromkeys(str(x) for x in labels))
        names.update(dict.fromkeys(self._fallback))
        return list(names)

    def condition(self, column: Any, text: str, *, what: str) -> Any:
        """A WHERE term: ``column`` (a class index) is the class named ``text``, or index."""
        terms = [
            and_(Sample.model_name == name, Sample.model_version == version, column == i)
            for name, version, labels in self._stored_models()
            for i, label in enumerate(labels)
            if label == text
        ]
        if terms:
            return or_(*terms)
        if text.isdigit():
            return column == int(text)
        known = self.known()
        hint = f"; known classes: {', '.join(known[:50])}" if known else ""
        raise ContractError(
            f"{what} {text!r} is neither a class name nor a class index{hint}",
            reason="invalid_filter",
        )

    def index(self, sample: Sample, text: str) -> int:
        """The class index of name (or index) ``text`` for ``sample``; ContractError if none."""
        names = self.for_sample(sample)
        if text in names:
            return names.index(text)
        if text.isdigit() and int(text) < len(names):
            return int(text)
        raise ContractError(
            f"{text!r} is not a class of sample {sample.sample_id}: use one of {', '.join(names)}",
            reason="invalid_label",
        )


def class_names_for(*, session: Session, state: ApiState) -> ClassNames:
    """The class-name lookup of one request; the teacher's names are the fallback."""
    if state.worker is not None:
        fallback: tuple[str, ...] = state.worker.teacher.info.labels
    else:
        fallback = model_file_labels(state.settings.resolved_teacher_model)
    return ClassNames(session, fallback=fallback)


def _named(labels: Sequence[str]) -> bool:
    """Whether ``labels`` are names rather than the indices themselves."""
    return bool(labels) and list(labels) != _index_names(len(labels))
