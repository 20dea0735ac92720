"""A distillation job's parameters: what each accepts, its checks, and its defaults.

``validate_params`` checks what users send (API, UI, CLI, schedules); ``JobParams`` is
the job's view with every default filled in.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, dataclass, fields
from typing import Any

from shared.errors import ContractError, InvalidIdError
from shared.topics import validate_id

__all__ = [
    "JOB_PARAMETERS",
    "JobParameter",
    "JobParams",
    "job_parameter_docs",
    "validate_params",
]


@dataclass(frozen=True)
class JobParameter:
    """One parameter a job accepts: its type, bounds and what it means."""

    name: str
    kind: type | tuple[type, ...]
    lo: float | None
    hi: float | None
    meaning: str

    @property
    def type_name(self) -> str:
        kinds = self.kind if isinstance(self.kind, tuple) else (self.kind,)
        return "number" if float in kinds else kinds[0].__name__


_P = JobParameter
_NUM = (int, float)
# Every parameter a job accepts; anything else is refused. Defaults live in JobParams
# (job_parameter_docs joins the two).
JOB_PARAMETERS: tuple[JobParameter, ...] = (
    _P("fleet", str, None, None, "the fleet whose verified samples train the job"),
    _P("model_name", str, None, None, "registry name of a first student"),
    _P("epochs", int, 1, 200, "training epochs (one-cycle schedule)"),
    _P("lr", _NUM, 1e-6, 1.0, "peak learning rate"),
    _P("batch_size", int, 8, 4096, "training batch size"),
    _P("temperature", _NUM, 0.5, 20.0, "distillation temperature on the teacher's scores"),
    _P("alpha", _NUM, 0.0, 1.0, "weight of the teacher term against the hard-label term"),
    _P("patience", int, 1, 100, "epochs without validation gain before stopping; unset: none"),
    _P("max_samples", int, 10, 1_000_000, "most verified samples taken, newest first"),
    _P("min_samples", int, 1, 1_000_000, "fewest verified samples the job runs on"),
    _P("replay_share", _NUM, 0.0, 0.95, "share of replayed earlier data in the training set"),
    _P("holdout_share", _NUM, 0.05, 0.5, "share held out for the gate (see the job runner)"),
    _P("val_share", _NUM, 0.05, 0.5, "share of the rest kept for validation"),
    _P("min_gain", _NUM, -1.0, 1.0, "accuracy gain over the serving student the gate asks for"),
    _P("max_reference_drop", _NUM, 0.0, 1.0, "largest accuracy fall allowed on the reference set"),
    _P("max_drift_drop", _NUM, 0.0, 1.0, "largest fall allowed under each evaluated drift"),
    _P("int8_tolerance", _NUM, 0.0, 1.0, "largest INT8 accuracy gap to its own FP32"),
    _P("threads", int, 1, 256, "torch threads of the job"),
    _P("wall_time_s", _NUM, 1.0, 7 * 86400.0, "seconds the job may run before it fails"),
    _P("delivery", str, None, None, "after the gate: promote, canary or none"),
    _P("canary_percent", _NUM, 1.0, 100.0, "share of the fleet in a canary rollout"),
    _P("drift_eval", str, None, None, "drifts evaluated, NAME:SEVERITY[,...]"),
    _P("drift_eval_frames", int, 10, 100_000, "frames per drift evaluation"),
    _P("base_checkpoint", str, None, None, "checkpoint to warm-start from; default: the serving"),
    _P("serving_model", str, None, None, "ONNX model the new one is compared with"),
    _P("teacher_model", str, None, None, "ONNX teacher that scores the replay data"),
    _P("quick", bool, None, None, "small, fast settings (tests and trials)"),
    _P("seed", int, 0, 2**31 - 1, "random seed"),
    _P("calibration_frames", int, 16, 100_000, "frames that calibrate the INT8 quantization"),
    _P("calibrate_confidence", bool, None, None, "fold a softmax temperature into the model"),
    _P("shift_px", int, 0, 16, "random shifts of training frames, pixels; 0: off"),
    _P("candidates", int, 1, 8, "students trained with consecutive seeds; the best is kept"),
    _P("data_dir", str, None, None, "labelled folder of the fleet's classes: replay, reference"),
    _P("min_per_class", int, 1, 100_000, "fewest labelled frames per class the job runs on"),
)
_PARAMS = {p.name: p for p in JOB_PARAMETERS}
_DELIVERY = ("promote", "canary", "none")


def validate_params(params: Mapping[str, Any]) -> dict[str, Any]:
    """Check a job's parameters; raise ContractError naming the bad one and what is accepted."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if key not in _PARAMS:
            raise ContractError(
                f"unknown job parameter {key!r}; accepted: {', '.join(sorted(_PARAMS))}"
            )
        spec = _PARAMS[key]
        kind, lo, hi = spec.kind, spec.lo, spec.hi
        if isinstance(value, bool) and kind is not bool:
            raise ContractError(f"job parameter {key!r} must be a number, got {value!r}")
        if not isinstance(value, kind):
            raise ContractError(
                f"job parameter {key!r} has the wrong type: got {type(value).__name__}"
            )
        if lo is not None and hi is not None and not lo <= float(value) <= hi:  # type: ignore[arg-type]
            raise ContractError(f"job parameter {key!r} must be in [{lo:g}, {hi:g}], got {value}")
        out[key] = value
    if out.get("delivery", "promote") not in _DELIVERY:
        raise ContractError(f"delivery must be one of {', '.join(_DELIVERY)}")
    if "fleet" in out:
        try:
            validate_id(str(out["fleet"]), "fleet")
        except InvalidIdError as exc:
            raise ContractError(f"job parameter 'fleet': {exc.message}") from exc
    if "drift_eval" in out:
        _check_drift_spec(str(out["drift_eval"]))
    return out


def _check_drift_spec(text: str) -> None:
    # Imported here: the drift module brings scipy, which the API process does not need
    # unless a job names its drifts.
    from distill.drift import DriftSpecError, parse_drift_spec

    try:
        parse_drift_spec(text)
    except DriftSpecError as exc:
        raise ContractError(f"job parameter 'drift_eval': {exc}") from exc


@dataclass(frozen=True)
class JobParams:
    """A job's knobs (``validate_params`` checks what users send)."""

    fleet: str = "default"
    model_name: str = "edgeloop-student"
    epochs: int = 10
    lr: float = 5e-4
    batch_size: int = 64
    temperature: float = 4.0
    alpha: float = 0.7
    # Unset, the whole one-cycle schedule runs and its last, annealed weights are kept:
    # judged on a validation split of a few dozen verified frames, the "best" epoch was
    # often the first, an under-trained student.
    patience: int | None = None
    max_samples: int = 5000
    min_samples: int = 50
    replay_share: float = 0.6
    holdout_share: float = 0.2
    val_share: float = 0.15
    min_gain: float = 0.0
    max_reference_drop: float = 0.02
    # When set, the new INT8 may fall at most this much under each evaluated drift too
    # (the reference set rendered with ``drift_eval``); unset, drifts are reported only.
    max_drift_drop: float | None = None
    int8_tolerance: float = 0.02
    threads: int = 1
    wall_time_s: float = 3600.0
    delivery: str = "promote"
    canary_percent: float = 25.0
    drift_eval: str = "background:1,rotation:1,lighting:1,blur:1,noise:1,jpeg:1"
    drift_eval_frames: int = 300
    base_checkpoint: str = ""
    serving_model: str = ""
    teacher_model: str = ""
    quick: bool = False
    seed: int = 0
    calibration_frames: int = 256
    calibrate_confidence: bool = True
    # Random shifts of training frames, up to this many pixels: a generic augmentation
    # that makes a few hundred verified frames go further (the closed loop's drifted
    # accuracy and its clean accuracy both rose with it; 0 turns it off).
    shift_px: int = 4
    # Training runs with seeds seed, seed+1, ...; the lowest validation NLL is kept.
    candidates: int = 1
    # A labelled folder (ImageFolder, COCO JSON or YOLO; see distill.datasets) of the
    # fleet's classes: its train split is replayed, its validation split watched, and its
    # test split is the reference set the gate holds the new student to.
    data_dir: str = ""
    # Each of the fleet's classes needs this many labelled frames (samples and data_dir).
    min_per_class: int = 5

    @classmethod
    def from_dict(cls, params: dict[str, Any]) -> JobParams:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in params.items() if k in known})


def job_parameter_docs() -> list[dict[str, Any]]:
    """Each parameter as ``{name, type, default, range, meaning}`` (``edgeloop jobs params``,
    the UI's job forms)."""
    defaults = {f.name: f.default for f in fields(JobParams) if f.default is not MISSING}
    rows = []
    for p in JOB_PARAMETERS:
        default = defaults.get(p.name)
        rows.append(
            {
                "name": p.name,
                "type": p.type_name,
                "default": None if default in ("", None) else default,
                "range": None if p.lo is None or p.hi is None else f"{p.lo:g}..{p.hi:g}",
                "meaning": p.meaning,
            }
        )
    return rows
