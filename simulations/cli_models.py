"""``edgeloop models``: bootstrap the reference pair, train on your own images, evaluate, quantize.

Errors an operator can fix (bad data folder, unreadable model, bad drift spec) print
one line on stderr and exit with status 2; no traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from cloud_service.settings import CloudSettings
from distill.cache import bootstrap_reference_models, default_cache_dir, reference_model_path
from distill.datasets import DIGITS, load_data
from distill.drift import DRIFT_KINDS, DriftSpecError, format_drift_spec, parse_drift_specs
from distill.evaluate import OnnxClassifier, evaluate, load_classifier
from distill.export import export_onnx, read_onnx_info
from distill.models import ModelMeta, model_profile, save_checkpoint
from distill.quantize import QuantSettings, quantization_frames, quantize_onnx, select_settings
from distill.train import TrainConfig, train
from edge_agent.settings import AgentSettings
from shared.errors import DataError, EdgeLoopError, ModelError
from simulations.cli_detection import train_detection_folder

__all__ = ["models_app"]

models_app = typer.Typer(
    help="Reference models: bootstrap the teacher/student pair, train on a folder of"
    " labelled images, evaluate under drift, quantize to INT8.",
    no_args_is_help=True,
)

_out = Console(highlight=False)
_err = Console(stderr=True, highlight=False)


class RoleChoice(StrEnum):
    teacher = "teacher"
    student = "student"


class TaskChoice(StrEnum):
    classification = "classification"
    detection = "detection"


JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]
CacheOpt = Annotated[
    Path | None,
    typer.Option(
        "--cache-dir",
        help="Model cache (default: $EDGELOOP_DATA_DIR/models/cache,"
        " else ~/.cache/edgeloop/models).",
    ),
]
QuickOpt = Annotated[
    bool, typer.Option("--quick", help="The small, seconds-to-train reference configuration.")
]
BootstrapQuickOpt = Annotated[
    bool,
    typer.Option(
        "--quick",
        envvar="EDGELOOP_BOOTSTRAP_QUICK",
        help="The small, seconds-to-train reference configuration.",
    ),
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        help="TOML settings of the process that serves the model (cloud-service for the"
        " teacher, edge-agent for the student); EDGELOOP_* variables win over it.",
    ),
]


@contextlib.contextmanager
def _friendly_errors() -> Iterator[None]:
    try:
        yield
    except (EdgeLoopError, DriftSpecError) as exc:
        message = exc.message if isinstance(exc, EdgeLoopError) else str(exc)
        _err.print(f"[bold red]error:[/] {' '.join(message.split())}", soft_wrap=True)
        raise typer.Exit(2) from None


def _print_json(obj: Any) -> None:
    typer.echo(json.dumps(obj, indent=2, sort_keys=True, default=str))


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def _resolve_model(model: str, cache_dir: Path | None, quick: bool) -> Path:
    path = Path(model).expanduser()
    if path.exists():
        return path
    if model in ("teacher", "student", "student-int8", "teacher.pt", "student.pt"):
        return reference_model_path(model, cache_dir, quick=quick)
    raise ModelError(
        f"no model at {model}; give an .onnx or .pt path, or teacher / student / student-int8"
        " for the cached reference models"
    )


def installed_model_path(role: str, config: Path | None = None) -> Path:
    """Where the process serving ``role`` loads its model: the cloud's teacher, the agent's
    student (``DATA_DIR/models/teacher.onnx`` and ``student.onnx`` unless configured)."""
    if role == "teacher":
        return CloudSettings.load(config).resolved_teacher_model
    if role == "student":
        return AgentSettings.load(config).resolved_model_path
    raise ModelError(f"unknown role {role!r}; roles: teacher, student")


def install_model(source: Path, role: str, config: Path | None = None) -> Path:
    """Put ``source`` where ``role``'s process loads it, after checking that ONNX Runtime
    loads it; the old file is replaced in one step (a reader sees the old or the new)."""
    import onnxruntime as ort

    source = source.expanduser()
    if not source.is_file():
        raise ModelError(f"no model file at {source}")
    try:
        ort.InferenceSession(str(source), providers=["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime raises its own untyped errors
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelError(f"{source} does not load in ONNX Runtime: {first}") from exc
    target = _replace(source, installed_model_path(role, config))
    # Weights beside it belong to the model it replaced: a warm start from them would be wrong.
    target.with_suffix(".pt").unlink(missing_ok=True)
    return target


def _replace(source: Path, target: Path) -> Path:
    """Copy ``source`` over ``target`` in one step (through a temporary file beside it)."""
    if target.exists() and target.resolve() == source.resolve():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        shutil.copyfile(source, tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


@models_app.command()
def bootstrap(
    quick: BootstrapQuickOpt = False,
    json_out: JsonOpt = False,
    cache_dir: CacheOpt = None,
    install: Annotated[
        bool,
        typer.Option(
            "--install/--no-install",
            help="Install the teacher and the INT8 student where cloud-service and"
            " edge-agent load them (DATA_DIR/models).",
        ),
    ] = True,
    config: ConfigOpt = None,
) -> None:
    """Train (if not cached) the reference teacher and student, install them, print figures."""
    with _friendly_errors():
        refs = bootstrap_reference_models(cache_dir, quick=quick, progress=True, console=_err)
        installed: dict[str, str] = {}
        if install:
            installed["teacher"] = str(install_model(refs.teacher_onnx, "teacher", config))
            student = install_model(refs.student_int8_onnx, "student", config)
            installed["student"] = str(student)
            # Its weights beside it: a distill worker on this host warm-starts from them.
            installed["student_weights"] = str(
                _replace(refs.student_pt, student.with_suffix(".pt"))
            )
        t, s = refs.metrics["teacher"], refs.metrics["student"]
        if json_out:
            _print_json(
                {
                    **{k: v for k, v in refs.to_dict().items() if k != "metrics"},
                    "installed": installed,
                    "cache_dir": str(cache_dir or default_cache_dir()),
                    "teacher": {k: v for k, v in t.items() if k not in ("history", "layers")},
                    "student": {k: v for k, v in s.items() if k not in ("history", "layers")},
                }
            )
            return
        table = Table(title=f"reference models{' (quick)' if quick else ''}")
        for col in ("model", "params", "MACs/frame", "file", "size", "test top-1", "train wall"):
            table.add_column(col, justify="left" if col in ("model", "file") else "right")
        rows = (
            ("teacher FP32", t, refs.teacher_onnx, t["onnx_bytes"], t["test_accuracy"], True),
            ("student FP32", s, refs.student_onnx, s["onnx_bytes"], s["test_accuracy"], True),
            (
                f"student INT8 {s['quantization']['settings']}",
                s,
                refs.student_int8_onnx,
                s["int8_bytes"],
                s["int8_test_accuracy"],
                False,
            ),
        )
        for label, m, path, size, acc, trained in rows:
            table.add_row(
                label,
                f"{m['params']:,}",
                f"{m['macs_per_frame'] / 1e6:.1f} M",
                path.name,
                f"{size / 1024:.0f} KB",
                _pct(acc),
                f"{m['train']['train_wall_s']:.0f} s" if trained else "",
            )
        _out.print(table)
        _out.print(f"teacher: {refs.teacher_onnx.parent}", soft_wrap=True)
        _out.print(f"student: {refs.student_onnx.parent}", soft_wrap=True)
        built = ", ".join(refs.built) if refs.built else "nothing (all cached)"
        _out.print(f"trained now: {built}")
        for role, where in installed.items():
            _out.print(f"installed the {role.replace('_', ' ')}: {where}", soft_wrap=True)


@models_app.command("install")
def install_cmd(
    model: Annotated[Path, typer.Argument(help="The ONNX file to serve.")],
    role: Annotated[
        RoleChoice,
        typer.Option("--role", help="teacher: the cloud verifier's; student: the agents'."),
    ],
    config: ConfigOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Install an ONNX model where cloud-service (teacher) or edge-agent (student) loads it."""
    with _friendly_errors():
        path = install_model(model, role.value, config)
    if json_out:
        _print_json({"role": role.value, "source": str(model), "installed": str(path)})
    else:
        _out.print(f"installed the {role.value}: {path}", soft_wrap=True)


@models_app.command("train")
def train_cmd(
    data: Annotated[
        str,
        typer.Option(
            "--data",
            help="Labelled images: a folder ROOT/<class>/<images>, a COCO annotations .json,"
            " a YOLO folder, or 'digits' for the built-in scenario.",
        ),
    ],
    role: Annotated[RoleChoice, typer.Option("--role", help="Which reference recipe to use.")],
    epochs: Annotated[int | None, typer.Option(help="Epochs (default: the role's).")] = None,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Checkpoint path (.pt); the ONNX file is written beside it."),
    ] = None,
    frame_size: Annotated[
        int | None,
        typer.Option(help="Square frame size in pixels (default: 64; detection 320)."),
    ] = None,
    batch_size: Annotated[int | None, typer.Option(help="Batch size.")] = None,
    lr: Annotated[float | None, typer.Option(help="Peak learning rate.")] = None,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    augment_drift: Annotated[
        bool | None,
        typer.Option(
            "--augment-drift/--no-augment-drift",
            help="Train on drifted frames (default: on for teacher, off for student).",
        ),
    ] = None,
    data_format: Annotated[
        str,
        typer.Option(
            "--format",
            help="How --data is laid out: auto (detected), imagefolder, coco (an annotations"
            " .json with its images beside it), yolo (txt labels; names in data.yaml or"
            " classes.txt).",
        ),
    ] = "auto",
    task: Annotated[
        TaskChoice,
        typer.Option(
            "--task",
            help="classification (one label per frame) or detection (boxes: --data is a"
            " COCO annotations .json or folder, or a YOLO folder).",
        ),
    ] = TaskChoice.classification,
    json_out: JsonOpt = False,
) -> None:
    """Train a teacher or student on labelled images; write .pt and .onnx (and, for a
    detection student, .int8.onnx)."""
    if task is TaskChoice.detection:
        with _friendly_errors():
            report = train_detection_folder(
                data,
                role=role.value,
                out=out,
                frame_size=frame_size or 320,
                epochs=epochs,
                batch_size=batch_size,
                lr=lr,
                seed=seed,
                console=_err,
            )
        _report(report, f"trained {role.value} detector on {data}", json_out)
        return
    frame_size = frame_size or 64
    with _friendly_errors():
        train_data = load_data(data, split="train", frame_size=frame_size, format=data_format)
        try:
            val_data = load_data(
                data, split="validation", frame_size=frame_size, format=data_format
            )
        except DataError:
            val_data = None  # a small folder may have no file hashed into validation
        overrides: dict[str, Any] = {"seed": seed, "frame_size": frame_size}
        for key, value in (
            ("epochs", epochs),
            ("batch_size", batch_size),
            ("lr", lr),
            ("augment_drift", augment_drift),
        ):
            if value is not None:
                overrides[key] = value
        cfg = TrainConfig.for_role(role.value, **overrides)
        out = out or Path(f"edgeloop-{role.value}.pt")
        onnx_path = out.with_suffix(".onnx")
        name = f"edgeloop-{role.value}"
        result = train(
            cfg,
            train_data.frames,
            None if val_data is None else val_data.frames,
            name=name,
            progress=True,
            console=_err,
        )
        profile = model_profile(result.net, frame_size)
        frames = train_data.frames
        save_checkpoint(
            out,
            result.net,
            ModelMeta(
                arch=cfg.arch,
                num_classes=frames.num_classes,
                class_names=frames.class_names,
                frame_size=frame_size,
                width=cfg.width,
                name=name,
                train_config=cfg.cache_fields(),
                metrics=result.metrics,
            ),
        )
        export = export_onnx(
            result.net,
            onnx_path,
            class_names=frames.class_names,
            frame_size=frame_size,
            name=name,
            version="0",
            check_frames=frames.frames[:32],
        )
        skipped = train_data.skipped_count + (0 if val_data is None else val_data.skipped_count)
        report = {
            "checkpoint": str(out),
            "onnx": str(onnx_path),
            "classes": list(frames.class_names),
            "train_frames": len(frames),
            "validation_frames": 0 if val_data is None else len(val_data.frames),
            "skipped_files": skipped,
            "params": profile["params"],
            "macs_per_frame": profile["macs"],
            "export_max_abs_diff": export.max_abs_diff_vs_torch,
            **{k: v for k, v in result.metrics.items() if k not in ("role", "arch")},
        }
        _report(report, f"trained {role.value} on {data}", json_out)


def _report(report: dict[str, Any], title: str, json_out: bool) -> None:
    if json_out:
        _print_json(report)
        return
    table = Table(title=title, show_header=False)
    for key, value in report.items():
        table.add_row(key, _fmt(value))
    _out.print(table)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return ", ".join(str(v) for v in value)
    return str(value)


@models_app.command("eval")
def eval_cmd(
    model: Annotated[
        str,
        typer.Argument(
            help="An .onnx or .pt file, or teacher / student / student-int8 (cached reference)."
        ),
    ],
    drift: Annotated[
        list[str] | None,
        typer.Option(
            "--drift",
            help="NAME:SEVERITY (severity 0..1), repeatable or comma-separated,"
            " e.g. --drift blur:0.8 --drift noise:1.0.",
        ),
    ] = None,
    data: Annotated[
        str, typer.Option("--data", help="A folder ROOT/<class>/<images>, or 'digits'.")
    ] = DIGITS,
    split: Annotated[
        str | None,
        typer.Option(
            help="Split to evaluate: digits test (default)/validation/train/stream;"
            " folders all (default)/train/validation/test."
        ),
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the drift's randomness.")] = 0,
    json_out: JsonOpt = False,
    cache_dir: CacheOpt = None,
    quick: QuickOpt = False,
) -> None:
    """Top-1 accuracy of a model on a split, optionally under drift."""
    with _friendly_errors():
        spec = parse_drift_specs(drift or [])
        path = _resolve_model(model, cache_dir, quick)
        clf = load_classifier(path)
        loaded = load_data(data, split=split, frame_size=clf.frame_size)
        result = evaluate(clf, loaded.frames, drift=spec, seed=seed)
        report = {
            **result.to_dict(),
            "model_path": str(path),
            "data": loaded.source,
            "split": loaded.split,
            "skipped_files": loaded.skipped_count,
        }
        if json_out:
            _print_json(report)
            return
        _out.print(
            f"{result.model} on {loaded.source}/{loaded.split}, drift {format_drift_spec(spec)}:"
            f" top-1 [bold]{100 * result.accuracy:.2f}%[/] ({result.correct}/{result.frames})"
        )
        if loaded.skipped_count:
            _out.print(f"skipped {loaded.skipped_count} unreadable file(s)")
        table = Table("class", "top-1")
        for name, acc in result.per_class.items():
            table.add_row(name, f"{100 * acc:.1f}%")
        _out.print(table)


@models_app.command()
def quantize(
    model: Annotated[str, typer.Argument(help="An FP32 EdgeLoop .onnx file (or 'student').")],
    calibration: Annotated[
        str,
        typer.Option(
            "--calibration",
            help="Labelled frames: a dataset (ImageFolder, COCO JSON, YOLO) whose train split"
            " calibrates and whose test split (else validation) is held out for the reported"
            " accuracy, or 'digits' (stream pool / test split).",
        ),
    ] = DIGITS,
    out: Annotated[
        Path | None,
        typer.Option(
            "--out",
            help="Output path (default: MODEL's name with .int8.onnx, beside MODEL, or in the"
            " current folder for a cached reference model).",
        ),
    ] = None,
    settings: Annotated[
        str,
        typer.Option(
            help="u8s8, s8s8, u8s8+rr, s8s8+rr (activations/weights, +rr = reduce_range), or"
            " 'auto' to measure all and keep the fastest within 1 point of FP32."
        ),
    ] = "u8s8+rr",
    json_out: JsonOpt = False,
    cache_dir: CacheOpt = None,
    quick: QuickOpt = False,
) -> None:
    """Static INT8 quantization (QDQ, per-channel) calibrated on frames."""
    with _friendly_errors():
        auto = settings.strip().lower() == "auto"
        qs = None if auto else QuantSettings.parse(settings)
        path = _resolve_model(model, cache_dir, quick)
        info = read_onnx_info(path)
        # Calibrated on one split, reported on another (held out): accuracy on the
        # calibration frames themselves says nothing about frames the model never saw.
        frames = quantization_frames(calibration, frame_size=info.frame_size)
        calib, check, check_note = frames.calibration, frames.held_out, frames.note
        int8_name = path.name.removesuffix(".onnx") + ".int8.onnx"
        # Never write into the model cache: its entries are immutable once built.
        out = out or (
            Path(int8_name) if not Path(model).expanduser().exists() else path.with_name(int8_name)
        )
        selection = None
        if qs is None:
            val = frames.selection
            chosen, _ = select_settings(
                path, calib.frames.frames, val.frames, out.parent / f".{out.stem}-trials"
            )
            selection = chosen
            qs = chosen.chosen
            shutil.rmtree(out.parent / f".{out.stem}-trials", ignore_errors=True)
        result = quantize_onnx(path, out, calib.frames.frames, qs)
        fp32 = evaluate(OnnxClassifier(path), check.frames)
        int8 = evaluate(OnnxClassifier(out), check.frames)
        report = {
            **result.to_dict(),
            "fp32_path": str(path),
            "fp32_accuracy": fp32.accuracy,
            "int8_accuracy": int8.accuracy,
            "accuracy_delta_points": round(100 * (int8.accuracy - fp32.accuracy), 3),
            "evaluated_on": check_note,
            "skipped_files": calib.skipped_count,
            "selection": None if selection is None else selection.to_dict(),
        }
        if json_out:
            _print_json(report)
            return
        if selection is not None:
            _out.print(selection.to_markdown())
            _out.print(selection.reason)
        table = Table(title=f"INT8 {qs.label}: {out}", show_header=False)
        table.add_row("size", f"{result.size_bytes / 1024:.0f} KB ({result.size_ratio:.2f}x FP32)")
        table.add_row("top-1 FP32", _pct(fp32.accuracy))
        table.add_row("top-1 INT8", _pct(int8.accuracy))
        table.add_row("evaluated on", check_note)
        table.add_row("calibration frames", str(result.calibration_frames))
        table.add_row("uint8 input folded", "yes" if result.folded_input else "no")
        if calib.skipped_count:
            table.add_row("skipped files", str(calib.skipped_count))
        _out.print(table)


@models_app.command()
def drifts() -> None:
    """List the drift kinds and what severity 1.0 means for each."""
    table = Table("drift", "at severity 1.0")
    for kind in DRIFT_KINDS.values():
        table.add_row(kind.name, kind.description)
    _out.print(table)
