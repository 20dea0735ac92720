"""The detection closed loop, measured: drift hits a detector fleet, the unsure frames go
to the teacher detector, a round distils a refreshed student, and mAP recovers.

    edgeloop loop --task detection [--quick] [--drift blur:0.5] [--rounds 1] [--json]

The parts are the product's: the edge's ``OrtEngine`` runs the INT8 student and its
``Router`` applies the agent's default detection rules (mean box score, share of
low-confidence boxes, an audit share of empty frames); each forwarded frame is
JPEG-encoded and wrapped in the sample envelope an agent uploads (its bytes are the
uplink figure); the verifier's ``TeacherModel`` answers it; ``shared.tasks.DETECTION``
compares the two, and a simulated reviewer corrects a share of the frames where they
differ with the scene's ground truth; ``distill.detector_distill`` trains the round's
student (warm start, replay of labelled reference frames), quantizes it and gates it on
mAP@0.5. What this loop leaves out, unlike the classification loop
(``simulations.closed_loop``), is the transport: no broker, database, registry or
agent processes; frames go from one part to the next in this process.

Frames: the detection scenario's stream split feeds the live phase, a new window of
it each round (the round's training data comes from it, added to what earlier rounds
kept, as the cloud keeps verified samples; the gate's recent data is a share of the
round's new frames); every figure in the table is measured on the test split,
whose source scans the stream never shows, clean and drifted with a fixed seed. The
gate judges on the validation split (ground truth), so the table's frames never
choose a model. mAP is pycocotools' (``distill.detector_eval``).
"""

from __future__ import annotations

import io
import random
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from rich.console import Console
from rich.table import Table

from cloud_service.verifier import TeacherModel
from distill.detector_cache import DetectorReferenceConfig, bootstrap_reference_detectors
from distill.detector_distill import DetectorGate, distil_detector
from distill.detector_eval import coco_metrics
from distill.detector_train import FrameBoxes, pseudo_labels
from distill.scene_drift import apply_scene_drift
from distill.scenes import DetectionSet, render_scenes
from edge_agent.engine import EngineOptions, OrtEngine
from edge_agent.routing import Router, RoutingPolicy
from edge_agent.settings import AgentSettings
from shared.envelope import encode_envelope
from shared.ids import new_sample_id
from shared.messages import SampleHeader
from shared.tasks import DETECTION

__all__ = ["DetectionLoopConfig", "run_detection_loop"]

JPEG_QUALITY = 85  # the agent's default upload quality


@dataclass(frozen=True)
class DetectionLoopConfig:
    quick: bool = False
    drift: str = "blur:0.5"
    rounds: int = 1
    live_frames: int = 0  # 0: the whole stream split
    max_samples: int = 400  # forwarded frames a round trains on
    human_share: float = 0.25  # of the frames where edge and teacher differ
    round_epochs: int = 0  # 0: the reference student's own
    replay_frames: int = 600  # labelled reference frames replayed against forgetting
    replay_share: float = 0.5  # of each epoch
    round_lr_scale: float = 0.25  # a round fine-tunes the serving student: a gentler rate
    threads: int = 1
    seed: int = 0


def _agent_policy() -> RoutingPolicy:
    """The agent's default routing for a detector (``AgentSettings``' own defaults)."""
    fields = AgentSettings.model_fields

    def default(name: str) -> Any:
        return fields[name].default

    box_min, box_max = default("route_box_count_min"), default("route_box_count_max")
    return RoutingPolicy(
        max_prob_below=None,
        mean_score_below=default("route_mean_score_below"),
        low_share_above=default("route_low_share_above"),
        near_threshold_at_least=default("route_near_threshold_at_least"),
        box_count_range=None if box_min is None and box_max is None else (box_min or 0, box_max),
        empty_audit_share=default("empty_audit_share"),
        audit_share=default("audit_share"),
    )


@dataclass
class _Pass:
    """One model over one set of frames: its rows and the router's decisions."""

    rows: np.ndarray
    forwarded: np.ndarray  # bool per frame
    reasons: dict[str, int]  # forwarded frames per routing rule


def _edge_pass(model: Path, frames: np.ndarray, seed: int, threads: int) -> _Pass:
    engine = OrtEngine(model, EngineOptions(intra_op_threads=threads, warmup_runs=0))
    router = Router(
        _agent_policy(),
        labels=list(engine.labels),
        clock=time.monotonic,
        rng=random.Random(seed),
        task=DETECTION,
    )
    rows, forwarded, reasons = [], [], Counter[str]()
    for i in range(0, len(frames), 16):
        batch = engine.run(np.ascontiguousarray(frames[i : i + 16]))
        rows.append(batch)
        decisions = router.decide_batch(batch)
        forwarded += [d.forward for d in decisions]
        reasons.update(str(d.reason) for d in decisions if d.forward)
    return _Pass(np.concatenate(rows), np.asarray(forwarded, dtype=bool), dict(reasons))


def _teacher_rows(teacher: TeacherModel, frames: np.ndarray) -> np.ndarray:
    return np.concatenate(
        [
            teacher.predict(np.ascontiguousarray(frames[i : i + 32]))
            for i in range(0, len(frames), 32)
        ]
    )


def _pad(rows: np.ndarray, k: int) -> np.ndarray:
    if rows.shape[1] >= k:
        return rows[:, :k]
    return np.concatenate([rows, np.zeros((len(rows), k - rows.shape[1], 6), rows.dtype)], 1)


def _hybrid(edge: _Pass, teacher: np.ndarray) -> np.ndarray:
    """The fleet's answers: the teacher's where the edge forwarded, else the edge's."""
    k = max(edge.rows.shape[1], teacher.shape[1])
    out = _pad(edge.rows, k).copy()
    out[edge.forwarded] = _pad(teacher, k)[edge.forwarded]
    return out


def _uplink_bytes(frames: np.ndarray, rows: np.ndarray, engine_name: str) -> int:
    """What the agent would send for these frames: JPEG plus the sample envelope."""
    total = 0
    for frame, row in zip(frames, rows, strict=True):
        buffer = io.BytesIO()
        Image.fromarray(frame).save(buffer, format="JPEG", quality=JPEG_QUALITY)
        image = buffer.getvalue()
        header = SampleHeader(
            sample_id=new_sample_id(),
            fleet="line-1",
            agent="cam-1",
            captured_at=datetime.now(UTC),
            model_name=engine_name,
            model_version="serving",
            route_reason="mean_score",
            image_format="jpeg",
            image_width=frame.shape[1],
            image_height=frame.shape[0],
            image_bytes=len(image),
            **DETECTION.sample_fields(row),
        )
        total += len(encode_envelope(header, image))
    return total


def _map(rows: np.ndarray, ds: DetectionSet) -> float:
    return round(coco_metrics(rows, ds).map50, 4)


def run_detection_loop(
    config: DetectionLoopConfig,
    *,
    cache_dir: Path | None = None,
    work_dir: Path | None = None,
    console: Console | None = None,
) -> dict[str, Any]:
    """Run the loop (see the module docstring); returns the table and the goals."""
    console = console or Console(stderr=True)
    started = time.perf_counter()
    refs = bootstrap_reference_detectors(cache_dir, quick=config.quick, progress=True)
    reference = DetectorReferenceConfig.reference(quick=config.quick)
    sc = reference.scenario
    # Each round watches its own window of the stream: frames the fleet has not shown
    # the cloud before, as a deployed fleet's next days would be.
    window = config.live_frames or sc.stream_frames
    stream = render_scenes("stream", replace(sc, stream_frames=window * config.rounds))
    test = render_scenes("test", sc)
    validation = render_scenes("validation", sc)
    replay = render_scenes("train", sc)
    replay = replay.subset(np.arange(min(config.replay_frames, len(replay))))
    live = apply_scene_drift(stream, config.drift, seed=config.seed + 11)
    test_drifted = apply_scene_drift(test, config.drift, seed=config.seed + 12)
    teacher = TeacherModel(refs.teacher_onnx, intra_op_threads=config.threads)
    teacher_test = _teacher_rows(teacher, test_drifted.frames)
    teacher_map = _map(teacher_test, test_drifted)

    def measure(model: Path, label: str) -> dict[str, Any]:
        clean = _edge_pass(model, test.frames, config.seed, config.threads)
        drifted = _edge_pass(model, test_drifted.frames, config.seed, config.threads)
        return {
            "phase": label,
            "edge_map50_clean": _map(clean.rows, test),
            "edge_map50_drifted": _map(drifted.rows, test_drifted),
            "hybrid_map50_drifted": _map(_hybrid(drifted, teacher_test), test_drifted),
            "forward_rate_drifted": round(float(drifted.forwarded.mean()), 4),
            "forward_rate_clean": round(float(clean.forwarded.mean()), 4),
            "forward_reasons_drifted": drifted.reasons,
        }

    serving_onnx, serving_pt = refs.student_int8_onnx, refs.student_pt
    rows = [measure(serving_onnx, "before rounds")]
    student_cfg = reference.student
    round_cfg = student_cfg.with_(
        threads=config.threads,
        replay_share=config.replay_share,
        lr=student_cfg.lr * config.round_lr_scale,
        epochs=config.round_epochs or student_cfg.epochs,
        seed=config.seed + 1,
    )
    rng = np.random.default_rng(config.seed)
    rounds: list[dict[str, Any]] = []
    # What the cloud has kept from earlier rounds (frames with teacher and human labels):
    # each round trains on all of it, as a distillation job reads the verified samples.
    kept_frames: list[np.ndarray] = []
    kept_teacher: list[FrameBoxes] = []
    kept_human: list[FrameBoxes | None] = []
    if work_dir is not None:
        work_dir.mkdir(parents=True, exist_ok=True)  # a fresh machine's data dir
    with tempfile.TemporaryDirectory(prefix="edgeloop-detloop-", dir=work_dir) as tmp:
        for k in range(1, config.rounds + 1):
            live_k = live.subset(np.arange((k - 1) * window, k * window))
            edge = _edge_pass(serving_onnx, live_k.frames, config.seed + k, config.threads)
            index = np.flatnonzero(edge.forwarded)[: config.max_samples]
            if len(index) < 10:
                rounds.append({"round": k, "skipped": f"only {len(index)} frames forwarded"})
                break
            t_rows = _teacher_rows(teacher, live_k.frames[index])
            teacher_labels = pseudo_labels(t_rows, sc.frame_size)
            human: list[FrameBoxes | None] = []
            for j, i in enumerate(index):
                differs = not DETECTION.compare(
                    DETECTION.answers(edge.rows[i][None])[0],
                    DETECTION.answers(t_rows[j][None])[0],
                ).agrees
                if differs and rng.random() < config.human_share:
                    human.append(FrameBoxes.of(live_k.boxes[i], live_k.classes[i]))
                else:
                    human.append(None)
            # The gate's recent data: a share of this round's frames, which no serving
            # model has trained on; the rest, and every kept frame, train.
            earlier = sum(len(f) for f in kept_frames)
            order = np.random.default_rng(config.seed + k).permutation(len(index))
            recent = earlier + np.sort(order[: max(1, round(0.2 * len(index)))])
            kept_frames.append(live_k.frames[index])
            kept_teacher += teacher_labels
            kept_human += human
            result = distil_detector(
                frames=np.concatenate(kept_frames),
                teacher=kept_teacher,
                human=kept_human,
                holdout=recent.tolist(),
                serving_checkpoint=serving_pt,
                serving_onnx=serving_onnx,
                reference=validation,
                replay=replay,
                drifts=[config.drift],
                out_dir=Path(tmp) / f"round-{k}",
                config=round_cfg,
                version=f"round-{k}",
                thresholds=DetectorGate(),
                seed=config.seed + k,
            )
            rounds.append(
                {
                    "round": k,
                    "forwarded": int(edge.forwarded.sum()),
                    "new_frames": len(index),
                    "trained_on": len(kept_teacher) - len(recent),
                    "human_labels": sum(h is not None for h in human),
                    "uplink_bytes": _uplink_bytes(
                        live_k.frames[edge.forwarded], edge.rows[edge.forwarded], "student"
                    ),
                    "live_frames": len(live_k),
                    "gate": {"passed": result.decision.passed, **result.decision.checks},
                    "gate_reasons": list(result.decision.reasons),
                    "evaluation_map50": result.evaluation,
                    "evaluation_map50_95": result.evaluation_50_95,
                }
            )
            if result.decision.passed:
                kept = Path(tmp) / f"serving-{k}"
                kept.mkdir()
                serving_onnx = Path(result.int8.replace(kept / "student.int8.onnx"))
                serving_pt = Path(result.checkpoint.replace(kept / "student.pt"))
            rows.append(measure(serving_onnx, f"after round {k}"))
    before, after = rows[0], rows[1] if len(rows) > 1 else rows[0]
    last = rows[-1]
    gap = before["edge_map50_clean"] - before["edge_map50_drifted"]
    goals = {
        "recovered_share_of_gap": round(
            (after["edge_map50_drifted"] - before["edge_map50_drifted"]) / gap, 3
        )
        if gap > 0
        else None,
        "clean_drop_points": round(
            100 * (before["edge_map50_clean"] - after["edge_map50_clean"]), 2
        ),
        "hybrid_vs_teacher": round(last["hybrid_map50_drifted"] / teacher_map, 3)
        if teacher_map
        else None,
        "forward_rate": last["forward_rate_drifted"],
    }
    report = {
        "task": "detection",
        "drift": config.drift,
        "quick": config.quick,
        "frame_size": sc.frame_size,
        "teacher_map50_drifted": teacher_map,
        "table": rows,
        "rounds": rounds,
        "goals": goals,
        "models": {
            "student": {
                k: refs.metrics["student"][k]
                for k in ("params", "macs_per_frame", "test", "int8_test")
            },
            "teacher": {
                k: refs.metrics["teacher"][k] for k in ("params", "macs_per_frame", "test")
            },
        },
        "wall_s": round(time.perf_counter() - started, 1),
    }
    console.print(render_table(report))
    return report


def render_table(report: dict[str, Any]) -> Table:
    """The loop's table: mAP@0.5 per phase, clean and drifted, with forwarding."""
    table = Table(title=f"Detection closed loop ({report['drift']}), mAP@0.5 on held-out frames")
    for column in ("phase", "clean", "drifted", "hybrid (drifted)", "forwarded (drifted)"):
        table.add_column(column, justify="right" if column != "phase" else "left")
    for row in report["table"]:
        table.add_row(
            row["phase"],
            f"{100 * row['edge_map50_clean']:.1f}",
            f"{100 * row['edge_map50_drifted']:.1f}",
            f"{100 * row['hybrid_map50_drifted']:.1f}",
            f"{100 * row['forward_rate_drifted']:.1f}%",
        )
    table.caption = f"teacher alone, drifted: {100 * report['teacher_map50_drifted']:.1f}"
    return table


def quick_config(**overrides: Any) -> DetectionLoopConfig:
    """A small loop on the quick detector pair, for tests."""
    return replace(
        DetectionLoopConfig(quick=True, live_frames=120, max_samples=120, replay_frames=60),
        **overrides,
    )
