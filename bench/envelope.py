"""Sample envelope: bytes on the wire and codec cost, against JSON with base64 images.

The envelope (12-byte prefix + JSON header + raw image) is compared side by side
with the obvious alternative it replaces: one JSON document with the image as a
base64 string.
"""

from __future__ import annotations

import base64
import io
import json
from datetime import UTC, datetime
from typing import Any

import numpy as np
from PIL import Image

from bench.common import markdown_table, median_seconds
from shared.envelope import EnvelopeLimits, decode_envelope, encode_envelope, envelope_overhead
from shared.ids import new_sample_id
from shared.messages import SampleHeader, encode_message


def typical_sample(size: int = 64, quality: int = 90) -> tuple[SampleHeader, bytes]:
    """A camera frame as the agent forwards it, with a realistic header."""
    rng = np.random.default_rng(0)
    pixels = (rng.random((size, size, 3)) * 60 + 100).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=quality)
    image = buffer.getvalue()
    scores = [0.61, 0.2, 0.05, 0.04, 0.03, 0.02, 0.02, 0.01, 0.01, 0.01]
    header = SampleHeader.model_validate(
        {
            "schema": SampleHeader.SCHEMA,
            "v": SampleHeader.VERSION,
            "sample_id": new_sample_id(),
            "fleet": "warehouse-eu-1",
            "agent": "conveyor-cam-042",
            "captured_at": datetime.now(UTC),
            "model_name": "digits-student",
            "model_version": "2026.11.29-3",
            "scores": scores,
            "predicted": 0,
            "confidence": 0.61,
            "route_reason": "low_confidence",
            "priority": 3,
            "image_format": "jpeg",
            "image_width": size,
            "image_height": size,
            "image_bytes": len(image),
        }
    )
    return header, image


def run(quick: bool = False) -> dict[str, Any]:
    repeats = 5 if quick else 9
    limits = EnvelopeLimits()
    rows = []
    figures: dict[str, Any] = {}
    for size in (64, 224, 640):
        header, image = typical_sample(size)
        envelope = encode_envelope(header, image, limits)
        as_json = json.loads(encode_message(header))
        as_json["image_b64"] = base64.b64encode(image).decode()
        json_doc = json.dumps(as_json, separators=(",", ":")).encode()

        loops = 200

        def decode_env(envelope: bytes = envelope, loops: int = loops) -> None:
            for _ in range(loops):
                decode_envelope(envelope, limits)

        def decode_json(json_doc: bytes = json_doc, loops: int = loops) -> None:
            for _ in range(loops):
                doc = json.loads(json_doc)
                base64.b64decode(doc.pop("image_b64"))
                SampleHeader.model_validate(doc)

        env_s = median_seconds(decode_env, repeats=repeats) / loops
        json_s = median_seconds(decode_json, repeats=repeats) / loops
        overhead = envelope_overhead(header)
        figures[f"{size}px"] = {
            "image_bytes": len(image),
            "envelope_bytes": len(envelope),
            "overhead_bytes": overhead,
            "json_base64_bytes": len(json_doc),
            "size_ratio_envelope_vs_json": len(envelope) / len(json_doc),
            "decode_us_envelope": env_s * 1e6,
            "decode_us_json_base64": json_s * 1e6,
            "decode_speedup_vs_json": json_s / env_s,
        }
        rows.append(
            [
                f"{size}x{size} JPEG",
                len(image),
                overhead,
                len(envelope),
                len(json_doc),
                round(env_s * 1e6, 1),
                round(json_s * 1e6, 1),
                round(json_s / env_s, 2),
            ]
        )
    table = markdown_table(
        [
            "frame",
            "image B",
            "envelope overhead B",
            "envelope B",
            "JSON+base64 B",
            "decode us (envelope)",
            "decode us (JSON+base64)",
            "decode speed-up",
        ],
        rows,
    )
    return {"figures": figures, "tables": [table]}
