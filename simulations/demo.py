"""``edgeloop demo``: the loop on embedded defaults, in one process tree.

An embedded MQTT broker; on the "edge" side the INT8 student answers each camera
frame of a stream that drifts halfway through and forwards the frames it is
unsure of (plus a small audit share) as sample envelopes at QoS 1; on the "cloud"
side a verifier decodes each envelope, runs the teacher, and answers with a
receipt and a verdict. Everything travels through the real broker, contracts and
models; the summary says what the loop saw.
"""

from __future__ import annotations

import io
import json
import random
import statistics
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import paho.mqtt.client as mqtt
from PIL import Image
from rich.console import Console
from rich.table import Table

from shared import (
    EmbeddedBroker,
    EnvelopeLimits,
    MqttTarget,
    Receipt,
    SampleHeader,
    Topics,
    Verdict,
    decode_envelope,
    decode_message,
    encode_envelope,
    encode_message,
    envelope_overhead,
    make_client,
    new_sample_id,
)
from shared.errors import ContractError
from shared.settings import EdgeLoopSettings

__all__ = ["DemoReport", "run_demo"]

FLEET, AGENT = "demo", "conveyor-cam-1"
AUDIT_SHARE = 0.05


@dataclass
class DemoReport:
    """What the demo saw, per phase of the stream (before and after the drift)."""

    frames: dict[str, int] = field(default_factory=lambda: {"clean": 0, "drift": 0})
    student_correct: dict[str, int] = field(default_factory=lambda: {"clean": 0, "drift": 0})
    forwarded: dict[str, int] = field(default_factory=lambda: {"clean": 0, "drift": 0})
    teacher_correct: dict[str, int] = field(default_factory=lambda: {"clean": 0, "drift": 0})
    verdicts: dict[str, int] = field(default_factory=lambda: {"clean": 0, "drift": 0})
    agreements: int = 0
    receipts: int = 0
    refused: int = 0
    bytes_sent: int = 0
    image_bytes: int = 0
    overheads: list[int] = field(default_factory=list)
    latencies_ms: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        def share(num: dict[str, int], den: dict[str, int]) -> dict[str, float | None]:
            return {k: (num[k] / den[k] if den[k] else None) for k in den}

        lat = sorted(self.latencies_ms)
        return {
            "frames": self.frames,
            "student_accuracy": share(self.student_correct, self.frames),
            "forward_rate": share(self.forwarded, self.frames),
            "teacher_accuracy_on_forwarded": share(self.teacher_correct, self.verdicts),
            "verdicts": self.verdicts,
            "receipts": self.receipts,
            "agreement_rate": (
                self.agreements / sum(self.verdicts.values())
                if any(self.verdicts.values())
                else None
            ),
            "envelope_overhead_bytes_median": (
                statistics.median(self.overheads) if self.overheads else None
            ),
            "bytes_sent": self.bytes_sent,
            "image_bytes": self.image_bytes,
            "capture_to_verdict_ms_p50": lat[len(lat) // 2] if lat else None,
            "capture_to_verdict_ms_p99": lat[min(len(lat) - 1, int(len(lat) * 0.99))]
            if lat
            else None,
            "refused": self.refused,
        }


def _session(path: Path) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # edge and cloud share this machine's cores in the demo
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _jpeg(frame: np.ndarray, quality: int = 90) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(frame).save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


class DemoVerifier:
    """The cloud side in miniature: decode, verify with the teacher, receipt, verdict."""

    def __init__(
        self, target: MqttTarget, topics: Topics, teacher: Path, limits: EnvelopeLimits
    ) -> None:
        self.topics = topics
        self.limits = limits
        self.teacher = _session(teacher)
        self.truth: dict[str, tuple[int, str]] = {}  # sample id -> (true label, phase)
        self.report: DemoReport | None = None
        self.lock = threading.Lock()
        self.client = make_client(target, client_id="demo-verifier", protocol="3.1.1")
        self.client.on_message = self._on_message
        self.client.connect(target.host, target.port)
        self.client.subscribe(topics.samples_filter(), qos=1)
        self.client.loop_start()

    def _on_message(self, client: mqtt.Client, userdata: Any, message: mqtt.MQTTMessage) -> None:
        try:
            envelope = decode_envelope(message.payload, self.limits)
        except ContractError:
            if self.report is not None:
                with self.lock:
                    self.report.refused += 1
            return
        header = envelope.header
        pixels = np.asarray(Image.open(io.BytesIO(envelope.image)).convert("RGB"))
        scores = self.teacher.run(None, {"frames": pixels[None]})[0][0]
        label = int(np.argmax(scores))
        receipt = Receipt(sample_ids=[header.sample_id], stored_at=datetime.now(UTC))
        client.publish(
            self.topics.receipts(header.fleet, header.agent), encode_message(receipt), qos=1
        )
        verdict = Verdict(
            sample_id=header.sample_id,
            fleet=header.fleet,
            agent=header.agent,
            teacher_model="digits-teacher",
            teacher_version="reference",
            scores=[float(s) for s in scores],
            label=label,
            confidence=float(scores[label]),
            agrees_with_edge=label == header.predicted,
            review=label != header.predicted or float(scores[label]) < 0.6,
            review_reasons=["disagreement"] if label != header.predicted else [],
            verified_at=datetime.now(UTC),
        )
        client.publish(
            self.topics.verdicts(header.fleet, header.agent), encode_message(verdict), qos=1
        )

    def stop(self) -> None:
        self.client.disconnect()
        self.client.loop_stop()


def run_demo(
    settings: EdgeLoopSettings,
    *,
    frames: int,
    drift: str,
    threshold: float,
    quick: bool,
    as_json: bool,
    cache_dir: Path | None = None,
) -> DemoReport:
    """Run the demo loop and print its summary; models come from ``cache_dir`` (trained once)."""
    from distill.cache import bootstrap_reference_models, default_cache_dir
    from distill.drift import DriftSchedule, FrameStream, parse_drift_spec
    from distill.scenario import ScenarioConfig, render_split

    console = Console(stderr=as_json)
    spec = parse_drift_spec(drift)
    console.print("[bold]EdgeLoop demo[/]: reference models (trained once, then cached)")
    models = bootstrap_reference_models(cache_dir or default_cache_dir(), quick=quick)
    pool = render_split("stream", ScenarioConfig())
    half = frames // 2
    stream = FrameStream(
        pool,
        drift=spec,
        schedule=DriftSchedule("gradual", start=half, length=max(1, frames // 4)),
        limit=frames,
        seed=7,
    )
    topics = Topics(prefix=settings.topic_prefix)
    limits = settings.envelope_limits
    report = DemoReport()
    sent_at: dict[str, float] = {}
    done = threading.Event()
    expected = {"n": -1}

    with EmbeddedBroker() as broker:
        target = MqttTarget.parse(broker.url)
        console.print(f"embedded MQTT broker on {broker.url}; drift {drift!r} from frame {half}")
        verifier = DemoVerifier(target, topics, models.teacher_onnx, limits)
        verifier.report = report
        student = _session(models.student_int8_onnx)
        edge = make_client(target, client_id=f"edge-{AGENT}", protocol="3.1.1")
        lock = threading.Lock()

        def on_edge_message(client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
            try:
                if msg.topic.endswith("/receipts"):
                    receipt = decode_message(msg.payload, Receipt)
                    with lock:
                        report.receipts += len(receipt.sample_ids)
                    return
                verdict = decode_message(msg.payload, Verdict)
            except ContractError:
                with lock:
                    report.refused += 1
                return
            with lock:
                label, phase = verifier.truth[verdict.sample_id]
                report.verdicts[phase] += 1
                report.teacher_correct[phase] += int(verdict.label == label)
                report.agreements += int(verdict.agrees_with_edge)
                report.latencies_ms.append((time.perf_counter() - sent_at[verdict.sample_id]) * 1e3)
                if sum(report.verdicts.values()) == expected["n"]:
                    done.set()

        edge.on_message = on_edge_message
        edge.connect(target.host, target.port)
        edge.subscribe([(topics.verdicts(FLEET, AGENT), 1), (topics.receipts(FLEET, AGENT), 1)])
        edge.loop_start()
        time.sleep(0.2)  # let both subscriptions settle before the first publish

        audit = random.Random(11)
        forwarded = 0
        for item in stream:
            phase = "clean" if item.index < half else "drift"
            scores = student.run(None, {"frames": item.frame[None]})[0][0]
            predicted = int(np.argmax(scores))
            confidence = float(scores[predicted])
            report.frames[phase] += 1
            report.student_correct[phase] += int(predicted == item.label)
            reason = None
            if confidence < threshold:
                reason = "low_confidence"
            elif audit.random() < AUDIT_SHARE:
                reason = "audit"
            if reason is None:
                continue
            image = _jpeg(item.frame)
            header = SampleHeader(
                sample_id=new_sample_id(),
                fleet=FLEET,
                agent=AGENT,
                captured_at=datetime.now(UTC),
                model_name="digits-student",
                model_version="reference-int8",
                scores=[float(s) for s in scores],
                predicted=predicted,
                confidence=confidence,
                route_reason=reason,
                priority=min(9, int(confidence * 10)),
                image_format="jpeg",
                image_width=item.frame.shape[1],
                image_height=item.frame.shape[0],
                image_bytes=len(image),
            )
            payload = encode_envelope(header, image, limits)
            with lock:
                verifier.truth[header.sample_id] = (item.label, phase)
                sent_at[header.sample_id] = time.perf_counter()
            edge.publish(topics.samples(FLEET, AGENT), payload, qos=1)
            forwarded += 1
            report.forwarded[phase] += 1
            report.bytes_sent += len(payload)
            report.image_bytes += len(image)
            report.overheads.append(envelope_overhead(header))

        with lock:
            expected["n"] = forwarded
            if sum(report.verdicts.values()) == forwarded:
                done.set()
        if not done.wait(timeout=60):
            console.print("[yellow]not every verdict arrived within 60 s[/]")
        edge.disconnect()
        edge.loop_stop()
        verifier.stop()

    summary = report.as_dict()
    if as_json:
        print(json.dumps(summary, indent=2))
    else:
        _print_summary(console, summary)
    return report


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _print_summary(console: Console, s: dict[str, Any]) -> None:
    table = Table(title="what the loop saw", show_lines=False)
    table.add_column("")
    table.add_column("clean phase", justify="right")
    table.add_column("drift phase", justify="right")
    table.add_row("frames", str(s["frames"]["clean"]), str(s["frames"]["drift"]))
    table.add_row(
        "student top-1 (edge)",
        _pct(s["student_accuracy"]["clean"]),
        _pct(s["student_accuracy"]["drift"]),
    )
    table.add_row(
        "forwarded to the cloud", _pct(s["forward_rate"]["clean"]), _pct(s["forward_rate"]["drift"])
    )
    table.add_row(
        "teacher top-1 on forwarded",
        _pct(s["teacher_accuracy_on_forwarded"]["clean"]),
        _pct(s["teacher_accuracy_on_forwarded"]["drift"]),
    )
    console.print(table)
    console.print(
        f"verdicts {sum(s['verdicts'].values())}, receipts {s['receipts']}, "
        f"edge/teacher agreement {_pct(s['agreement_rate'])}, refused {s['refused']}"
    )
    console.print(
        f"sent {s['bytes_sent']} bytes ({s['image_bytes']} of images); envelope overhead "
        f"median {s['envelope_overhead_bytes_median']} bytes per sample"
    )
    if s["capture_to_verdict_ms_p50"] is not None:
        console.print(
            f"capture-to-verdict latency p50 {s['capture_to_verdict_ms_p50']:.1f} ms, "
            f"p99 {s['capture_to_verdict_ms_p99']:.1f} ms"
        )
