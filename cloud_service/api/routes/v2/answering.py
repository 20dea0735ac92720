"""Answering a V2 infer request: scores as JSON or binary tensors, classification, compression."""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from cloud_service.api.routes.v2.protocol import OUTPUT_DATATYPE, V2Error, V2InferRequest
from cloud_service.api.routes.v2.reading import (
    decompressed,
    parse_request,
    request_frames,
    split_body,
)
from cloud_service.verifier import ModelInfo, TeacherModel
from shared.errors import EdgeLoopError, ModelError

__all__ = ["InferAnswer", "accepted_coding", "answer_infer", "compressed"]


@dataclass(frozen=True)
class _Wanted:
    binary: bool
    classes: int


def _wanted(request: V2InferRequest, info: ModelInfo) -> _Wanted:
    params = request.parameters
    default_binary = bool(params is not None and params.binary_data_output)
    if not request.outputs:
        return _Wanted(default_binary, 0)
    names = [output.name for output in request.outputs]
    if names != [info.output_name]:
        raise V2Error(f"the model has one output, {info.output_name!r}; the request asks {names}")
    out = request.outputs[0].parameters
    if out is not None and out.model_extra and "shared_memory_region" in out.model_extra:
        raise V2Error(f"output {info.output_name!r}: shared memory is not supported")
    binary = out.binary_data if out is not None and out.binary_data is not None else default_binary
    classes = out.classification if out is not None and out.classification else 0
    if classes and info.task != "classification":
        raise V2Error(
            f"output {info.output_name!r}: classification answers a classifier's scores;"
            f" this model answers the {info.task} task"
        )
    return _Wanted(binary, classes)


def _classified(scores: np.ndarray, k: int, labels: tuple[str, ...]) -> list[bytes]:
    """Triton's classification: the top ``k`` of each row as b"score:index:label"."""
    k = min(k, scores.shape[1])
    top = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    strings = []
    for row, indices in zip(scores, top, strict=True):
        for i in indices.tolist():
            label = f":{labels[i]}" if i < len(labels) else ""
            strings.append(f"{row[i]:f}:{i}{label}".encode())
    return strings


def _encoded(scores: np.ndarray, info: ModelInfo, wanted: _Wanted) -> tuple[dict[str, Any], bytes]:
    """The output's JSON entry and its binary data (empty when sent as JSON)."""
    entry: dict[str, Any] = {"name": info.output_name}
    if wanted.classes:
        strings = _classified(scores, wanted.classes, info.labels)
        entry |= {"datatype": "BYTES", "shape": [scores.shape[0], len(strings) // scores.shape[0]]}
        if not wanted.binary:
            entry["data"] = [s.decode() for s in strings]
            return entry, b""
        # BYTES elements travel as a 4-byte little-endian length and the bytes.
        raw = b"".join(len(s).to_bytes(4, "little") + s for s in strings)
    else:
        entry |= {"datatype": OUTPUT_DATATYPE, "shape": list(scores.shape)}
        if not wanted.binary:
            entry["data"] = scores.reshape(-1).tolist()
            return entry, b""
        raw = np.ascontiguousarray(scores, dtype="<f4").tobytes()
    entry["parameters"] = {"binary_data_size": len(raw)}
    return entry, raw


def accepted_coding(accept: str) -> str | None:
    """gzip or deflate where the client's Accept-Encoding takes it (q above 0)."""
    taken = set()
    for part in accept.split(","):
        coding, *params = (p.strip() for p in part.split(";"))
        quality = 1.0
        for param in params:
            key, _, value = param.partition("=")
            if key.strip().lower() == "q":
                try:
                    quality = float(value)
                except ValueError:
                    quality = 0.0
        if quality > 0:
            taken.add(coding.lower())
    return next((c for c in ("gzip", "deflate") if c in taken), None)


def compressed(body: bytes, coding: str) -> bytes:
    if coding == "gzip":
        packer = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    else:
        packer = zlib.compressobj(6)
    return packer.compress(body) + packer.flush()


@dataclass(frozen=True)
class InferAnswer:
    header: bytes
    binary: bytes


def answer_infer(
    teacher: TeacherModel, name: str, body: bytes, *, encoding: str, header_length: str | None
) -> InferAnswer:
    """Answer one infer request's body (as sent, compressed or not)."""
    info = teacher.info
    header, binary = split_body(decompressed(body, encoding), header_length)
    request = parse_request(header)
    wanted = _wanted(request, info)
    frames = request_frames(request, binary, info)
    try:
        scores = teacher.predict(frames)
    except ModelError as exc:
        raise V2Error(exc.message, 503) from None
    except EdgeLoopError as exc:
        raise V2Error(exc.message) from None
    entry, raw = _encoded(scores, info, wanted)
    document: dict[str, Any] = {"model_name": name, "model_version": info.version}
    if request.id is not None:
        document["id"] = request.id
    document["outputs"] = [entry]
    return InferAnswer(json.dumps(document, separators=(",", ":")).encode(), raw)
