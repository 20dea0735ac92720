"""Reading a V2 infer request: its body within the limits, decoding, JSON and binary tensors."""

from __future__ import annotations

import json
import math
import re
import zlib

import numpy as np
from fastapi import Request
from pydantic import ValidationError

from cloud_service.api.routes.v2.protocol import (
    DATATYPES,
    HEADER_LENGTH,
    INPUT_DATATYPE,
    V2Error,
    V2InferRequest,
    V2Input,
    error_summary,
)
from cloud_service.verifier import ModelInfo

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_ELEMENTS",
    "decompressed",
    "parse_request",
    "read_body",
    "request_frames",
    "split_body",
]

# A request holds at most this many input elements (64 frames of 224x224x3): JSON
# tensors are expensive to parse, and this keeps one request from taking the host.
MAX_ELEMENTS = 64 * 224 * 224 * 3
# A body (after decompression) holds at most this many bytes: room for MAX_ELEMENTS
# UINT8 values written as JSON ("255, " is 5 bytes) and the rest of the header.
MAX_BODY_BYTES = 5 * MAX_ELEMENTS + (1 << 20)


def _length(text: str) -> int | None:
    """A header's decimal length, or None (``str.isdigit`` also takes "²", which int() refuses)."""
    return int(text) if re.fullmatch(r"[0-9]{1,18}", text.strip()) else None


async def read_body(request: Request) -> bytes:
    declared = _length(request.headers.get("content-length", ""))
    if declared is not None and declared > MAX_BODY_BYTES:
        raise V2Error(f"the body of {declared} bytes is over the limit of {MAX_BODY_BYTES}", 413)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise V2Error(f"the body is over the limit of {MAX_BODY_BYTES} bytes", 413)
        chunks.append(chunk)
    return b"".join(chunks)


def decompressed(body: bytes, encoding: str) -> bytes:
    coding = encoding.strip().lower()
    if coding in {"", "identity"}:
        return body
    if coding not in {"gzip", "deflate"}:
        raise V2Error(
            f"Content-Encoding {encoding!r} is not accepted; send gzip, deflate or identity", 415
        )
    # gzip: a gzip member; deflate: the zlib format, as HTTP's "deflate" means.
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if coding == "gzip" else zlib.MAX_WBITS)
    try:
        plain = inflater.decompress(body, MAX_BODY_BYTES + 1)
    except zlib.error as exc:
        raise V2Error(f"the body is not valid {coding} data: {exc}") from None
    if len(plain) > MAX_BODY_BYTES:
        raise V2Error(f"the decompressed body is over the limit of {MAX_BODY_BYTES} bytes", 413)
    if not inflater.eof:
        raise V2Error(f"the {coding} body is truncated")
    return plain


def split_body(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """The JSON header and the binary tensor data after it."""
    if header_length is None:
        return body, b""
    length = _length(header_length)
    if length is None or not 0 < length <= len(body):
        raise V2Error(
            f"{HEADER_LENGTH} {header_length!r} is not a length within the body's {len(body)} bytes"
        )
    return body[:length], body[length:]


def parse_request(header: bytes) -> V2InferRequest:
    try:
        document = json.loads(header)
    except (ValueError, RecursionError) as exc:
        raise V2Error(f"the inference request is not JSON: {exc}") from None
    try:
        return V2InferRequest.model_validate(document)
    except ValidationError as exc:
        raise V2Error(
            f"the inference request is not valid: {error_summary(exc.errors())}"
        ) from None


def _binary_sections(request: V2InferRequest, binary: bytes) -> list[bytes | None]:
    """Each input's raw bytes (None where it sends JSON data), in the request's order."""
    sections: list[bytes | None] = []
    offset = 0
    for tensor in request.inputs:
        params = tensor.parameters
        if (
            params is not None
            and params.model_extra
            and "shared_memory_region" in params.model_extra
        ):
            raise V2Error(f"input {tensor.name!r}: shared memory is not supported; send the data")
        size = params.binary_data_size if params is not None else None
        if size is None:
            sections.append(None)
            continue
        if offset + size > len(binary):
            raise V2Error(
                f"input {tensor.name!r}: binary_data_size {size} runs past the body's"
                f" {len(binary)} bytes of binary data (send {HEADER_LENGTH} with the JSON length)"
            )
        sections.append(binary[offset : offset + size])
        offset += size
    if offset != len(binary):
        raise V2Error(
            f"the body holds {len(binary) - offset} bytes past the inputs' binary_data_size"
        )
    return sections


def request_frames(request: V2InferRequest, binary: bytes, info: ModelInfo) -> np.ndarray:
    """The request's frames, uint8 [N, H, W, 3], checked against the model."""
    sections = _binary_sections(request, binary)
    names = [tensor.name for tensor in request.inputs]
    if names != [info.input_name]:
        raise V2Error(f"the model takes one input, {info.input_name!r}; the request sends {names}")
    tensor, section = request.inputs[0], sections[0]
    if tensor.datatype not in DATATYPES:
        raise V2Error(f"datatype {tensor.datatype!r} is not a V2 datatype ({', '.join(DATATYPES)})")
    if tensor.datatype != INPUT_DATATYPE:
        raise V2Error(
            f"input {tensor.name!r} is {tensor.datatype}; the model takes {INPUT_DATATYPE}"
        )
    shape = tensor.shape
    if len(shape) != 4 or shape[3] != 3 or any(d < 1 for d in shape):
        raise V2Error(f"input shape {shape} is not accepted; send [N, H, W, 3] with N >= 1")
    if (info.height is not None and shape[1] != info.height) or (
        info.width is not None and shape[2] != info.width
    ):
        h, w = (d if d is not None else axis for d, axis in ((info.height, "H"), (info.width, "W")))
        raise V2Error(f"input shape {shape}: the model takes [N, {h}, {w}, 3]")
    count = math.prod(shape)  # Python ints: no overflow on a shape like [2**52 + 1, ...]
    if count > MAX_ELEMENTS:
        raise V2Error(f"input of {count} elements is over the limit of {MAX_ELEMENTS}")
    if section is not None:
        if tensor.data is not None:
            raise V2Error(f"input {tensor.name!r} sends both data and binary_data_size")
        if len(section) != count:
            raise V2Error(
                f"input {tensor.name!r}: binary_data_size {len(section)} does not fit shape"
                f" {shape} of {INPUT_DATATYPE} ({count} bytes)"
            )
        return np.frombuffer(section, dtype=np.uint8).reshape(shape).copy()
    return _json_frames(tensor, count)


def _json_frames(tensor: V2Input, count: int) -> np.ndarray:
    data = tensor.data
    if not isinstance(data, list):
        raise V2Error(
            f"input {tensor.name!r} needs data (a JSON array of {count} integers 0-255)"
            " or parameters.binary_data_size"
        )
    try:
        values = np.array(data)
    except (ValueError, TypeError, RecursionError) as exc:
        raise V2Error(f"input {tensor.name!r}: data is not a regular array: {exc}") from None
    if values.size != count:
        raise V2Error(f"input data holds {values.size} values; shape {tensor.shape} needs {count}")
    if values.dtype.kind not in "iu" or values.min() < 0 or values.max() > 255:
        raise V2Error("UINT8 input data must be integers 0-255")
    return values.astype(np.uint8).reshape(tensor.shape)
