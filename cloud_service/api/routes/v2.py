"""The teacher over the Open Inference Protocol (KServe V2), for existing V2 clients.

Only the teacher is served, under ``settings.teacher_name`` and its one version; the
input is the model contract's ``frames`` (UINT8 [N, H, W, 3]), the output ``scores``
(FP32 [N, C]). Besides the core protocol the routes speak Triton's HTTP extensions that
its clients use by default: binary tensor data (``Inference-Header-Content-Length``: a
JSON header, then raw tensor bytes, in requests and responses), classification (an
output's ``parameters.classification`` = k answers the top k as "score:index:label"),
model configuration (``/config``), and gzip/deflate bodies. An infer body is read by
its bytes, whatever its Content-Type says. Every error on a ``/v2`` path answers
``{"error": "..."}``: 400 for a request the model cannot take, 404 for an unknown
model, version or path, 405, 413 over the size limit, 415 for an unknown body
encoding, 503 while the teacher cannot run.
"""

from __future__ import annotations

import json
import math
import re
import zlib
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from importlib import metadata as package_metadata
from typing import Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.routing import Match

from cloud_service.api.deps import StateDep
from cloud_service.verifier import ModelInfo, TeacherModel
from shared.errors import ContractError, EdgeLoopError, ModelError

__all__ = ["MAX_BODY_BYTES", "MAX_ELEMENTS", "V2Error", "router"]

# A request holds at most this many input elements (64 frames of 224x224x3): JSON
# tensors are expensive to parse, and this keeps one request from taking the host.
MAX_ELEMENTS = 64 * 224 * 224 * 3
# A body (after decompression) holds at most this many bytes: room for MAX_ELEMENTS
# UINT8 values written as JSON ("255, " is 5 bytes) and the rest of the header.
MAX_BODY_BYTES = 5 * MAX_ELEMENTS + (1 << 20)

HEADER_LENGTH = "Inference-Header-Content-Length"
EXTENSIONS = ("binary_tensor_data", "classification", "model_configuration")
INPUT_DATATYPE = "UINT8"
OUTPUT_DATATYPE = "FP32"

# Every V2 datatype, to tell a misspelt one from one the model does not take.
DATATYPES = (
    "BOOL", "UINT8", "UINT16", "UINT32", "UINT64", "INT8", "INT16", "INT32", "INT64",
    "FP16", "FP32", "FP64", "BF16", "BYTES",
)  # fmt: skip


class V2Error(ContractError):
    """An inference request or path the V2 endpoints refuse, with its HTTP status."""

    reason = "bad_inference_request"

    def __init__(self, message: str, status: int = 400, *, allow: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.allow = allow


def _error(exc: V2Error) -> JSONResponse:
    headers = {"Allow": exc.allow} if exc.allow else None
    return JSONResponse({"error": exc.message}, status_code=exc.status, headers=headers)


class _V2Route(APIRoute):
    """A route whose errors, FastAPI's own included, answer ``{"error": ...}``."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def handler(request: Request) -> Response:
            try:
                return await handle(request)
            except V2Error as exc:
                return _error(exc)
            except RequestValidationError as exc:
                return _error(V2Error(f"request is not valid: {_summary(exc.errors())}"))
            except HTTPException as exc:
                return _error(V2Error(str(exc.detail), exc.status_code))

        return handler


router = APIRouter(prefix="/v2", tags=["inference (KServe V2)"], route_class=_V2Route)


# --- the request and its parts ---------------------------------------------------


class _Parameters(BaseModel):
    # Clients add their own parameters (Triton's: priority, timeout, sequence_id).
    model_config = ConfigDict(extra="allow")


class V2InputParameters(_Parameters):
    binary_data_size: StrictInt | None = Field(default=None, ge=0)


class V2Input(BaseModel):
    name: str = Field(max_length=256)
    shape: list[StrictInt] = Field(max_length=8)
    datatype: str = Field(max_length=16)
    parameters: V2InputParameters | None = None
    data: Any = None


class V2OutputParameters(_Parameters):
    binary_data: StrictBool | None = None
    classification: StrictInt | None = Field(default=None, ge=0)


class V2RequestedOutput(BaseModel):
    name: str = Field(max_length=256)
    parameters: V2OutputParameters | None = None


class V2RequestParameters(_Parameters):
    binary_data_output: StrictBool | None = None


class V2InferRequest(BaseModel):
    id: str | None = Field(default=None, max_length=256)
    parameters: V2RequestParameters | None = None
    inputs: list[V2Input] = Field(min_length=1, max_length=8)
    outputs: list[V2RequestedOutput] | None = Field(default=None, max_length=8)


def _summary(errors: Any) -> str:
    parts = []
    for error in list(errors)[:5]:
        where = ".".join(str(p) for p in error.get("loc", ()))
        parts.append(f"{where}: {error.get('msg', 'invalid')}")
    return "; ".join(parts)


def _inline(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with its ``$defs`` references written out (OpenAPI reads no $defs)."""
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    resolved: dict[str, Any] = resolve(schema)
    return resolved


_INFER_OPENAPI: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "description": (
            "The inference request as JSON; with the binary tensor data extension the"
            f" first {HEADER_LENGTH} bytes are that JSON and raw tensor bytes follow."
        ),
        "content": {
            "application/json": {"schema": _inline(V2InferRequest.model_json_schema())},
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
        },
    }
}


# --- the served model -------------------------------------------------------------


def _served(state: StateDep, name: str, version: str | None) -> TeacherModel:
    served = state.settings.teacher_name
    if name != served:
        raise V2Error(f"model {name!r} is not served here; the model is {served!r}", 404)
    teacher = state.teacher()
    if teacher is None:
        raise V2Error(f"model {name!r} is not loaded: {state.teacher_error}", 503)
    if version is not None and version != teacher.info.version:
        raise V2Error(
            f"model {name!r} has no version {version!r}; it serves {teacher.info.version!r}",
            404,
        )
    return teacher


def _input_dims(info: ModelInfo) -> list[int]:
    h = info.height if info.height is not None else -1
    w = info.width if info.width is not None else -1
    return [h, w, 3]


def _output_width(info: ModelInfo) -> int:
    return len(info.labels) if info.labels else -1


def _metadata(name: str, info: ModelInfo) -> dict[str, Any]:
    return {
        "name": name,
        "versions": [info.version],
        "platform": "onnxruntime_onnx",
        "inputs": [
            {"name": info.input_name, "datatype": INPUT_DATATYPE, "shape": [-1, *_input_dims(info)]}
        ],
        "outputs": [
            {
                "name": info.output_name,
                "datatype": OUTPUT_DATATYPE,
                "shape": [-1, _output_width(info)],
            }
        ],
        "parameters": {"labels": list(info.labels), "provider": info.provider},
    }


def _config(name: str, info: ModelInfo) -> dict[str, Any]:
    """The model as a Triton model configuration (its JSON form)."""
    dims = _input_dims(info)
    if -1 in dims:
        # Frames of any size: no batch bound that holds for every size, so the batch
        # axis is written into the dims (Triton's max_batch_size 0).
        max_batch, input_dims, output_dims = 0, [-1, *dims], [-1, _output_width(info)]
    else:
        max_batch, input_dims, output_dims = (
            MAX_ELEMENTS // math.prod(dims),
            dims,
            [_output_width(info)],
        )
    on_gpu = info.provider in {"CUDAExecutionProvider", "TensorrtExecutionProvider"}
    return {
        "name": name,
        "platform": "onnxruntime_onnx",
        "backend": "onnxruntime",
        "version_policy": {"specific": {"versions": [info.version]}},
        "max_batch_size": max_batch,
        "input": [
            {
                "name": info.input_name,
                "data_type": f"TYPE_{INPUT_DATATYPE}",
                "format": "FORMAT_NHWC",
                "dims": input_dims,
            }
        ],
        "output": [
            {"name": info.output_name, "data_type": f"TYPE_{OUTPUT_DATATYPE}", "dims": output_dims}
        ],
        "instance_group": [{"kind": "KIND_GPU" if on_gpu else "KIND_CPU", "count": 1}],
        "parameters": {"labels": {"string_value": json.dumps(list(info.labels))}},
    }


def _server_version() -> str:
    try:
        return package_metadata.version("edgeloop")
    except package_metadata.PackageNotFoundError:
        return "unknown"


# --- reading an infer request -----------------------------------------------------


def _length(text: str) -> int | None:
    """A header's decimal length, or None (``str.isdigit`` also takes "²", which int() refuses)."""
    return int(text) if re.fullmatch(r"[0-9]{1,18}", text.strip()) else None


async def _read_body(request: Request) -> bytes:
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


def _decompressed(body: bytes, encoding: str) -> bytes:
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


def _split(body: bytes, header_length: str | None) -> tuple[bytes, bytes]:
    """The JSON header and the binary tensor data after it."""
    if header_length is None:
        return body, b""
    length = _length(header_length)
    if length is None or not 0 < length <= len(body):
        raise V2Error(
            f"{HEADER_LENGTH} {header_length!r} is not a length within the body's {len(body)} bytes"
        )
    return body[:length], body[length:]


def _parse(header: bytes) -> V2InferRequest:
    try:
        document = json.loads(header)
    except (ValueError, RecursionError) as exc:
        raise V2Error(f"the inference request is not JSON: {exc}") from None
    try:
        return V2InferRequest.model_validate(document)
    except ValidationError as exc:
        raise V2Error(f"the inference request is not valid: {_summary(exc.errors())}") from None


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


def _frames(request: V2InferRequest, binary: bytes, info: ModelInfo) -> np.ndarray:
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


# --- answering ------------------------------------------------------------------


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


def _accepted_coding(accept: str) -> str | None:
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


def _compressed(body: bytes, coding: str) -> bytes:
    if coding == "gzip":
        packer = zlib.compressobj(6, zlib.DEFLATED, 16 + zlib.MAX_WBITS)
    else:
        packer = zlib.compressobj(6)
    return packer.compress(body) + packer.flush()


@dataclass(frozen=True)
class _Answer:
    header: bytes
    binary: bytes


def _infer(
    teacher: TeacherModel, name: str, body: bytes, *, encoding: str, header_length: str | None
) -> _Answer:
    """Answer one infer request's body (as sent, compressed or not)."""
    info = teacher.info
    header, binary = _split(_decompressed(body, encoding), header_length)
    request = _parse(header)
    wanted = _wanted(request, info)
    frames = _frames(request, binary, info)
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
    return _Answer(json.dumps(document, separators=(",", ":")).encode(), raw)


async def _infer_route(
    request: Request, state: StateDep, name: str, version: str | None
) -> Response:
    # The whole body is read first: a client still sending when the answer comes would
    # see a broken connection instead of the error.
    body = await _read_body(request)
    teacher = _served(state, name, version)
    # Inflating and parsing a large tensor and running the model take a while: off the loop.
    answer = await run_in_threadpool(
        lambda: _infer(
            teacher,
            name,
            body,
            encoding=request.headers.get("content-encoding", ""),
            header_length=request.headers.get(HEADER_LENGTH),
        )
    )
    headers: dict[str, str] = {}
    if answer.binary:
        content, media_type = answer.header + answer.binary, "application/octet-stream"
        headers[HEADER_LENGTH] = str(len(answer.header))
    else:
        content, media_type = answer.header, "application/json"
    coding = _accepted_coding(request.headers.get("accept-encoding", ""))
    if coding is not None:
        content = await run_in_threadpool(_compressed, content, coding)
        headers["Content-Encoding"] = coding
    return Response(content, media_type=media_type, headers=headers)


# --- the routes -------------------------------------------------------------------


@router.get("")
def server_metadata() -> dict[str, Any]:
    return {"name": "edgeloop", "version": _server_version(), "extensions": list(EXTENSIONS)}


@router.get("/health/live")
def live() -> dict[str, bool]:
    return {"live": True}


@router.get("/health/ready")
def ready(state: StateDep) -> JSONResponse:
    is_ready = state.teacher() is not None
    return JSONResponse({"ready": is_ready}, status_code=200 if is_ready else 503)


@router.get("/models/{name}")
def model_metadata(name: str, state: StateDep) -> dict[str, Any]:
    return _metadata(name, _served(state, name, None).info)


@router.get("/models/{name}/versions/{version}")
def version_metadata(name: str, version: str, state: StateDep) -> dict[str, Any]:
    return _metadata(name, _served(state, name, version).info)


@router.get("/models/{name}/ready")
def model_ready(name: str, state: StateDep) -> dict[str, Any]:
    _served(state, name, None)
    return {"name": name, "ready": True}


@router.get("/models/{name}/versions/{version}/ready")
def version_ready(name: str, version: str, state: StateDep) -> dict[str, Any]:
    _served(state, name, version)
    return {"name": name, "version": version, "ready": True}


@router.get("/models/{name}/config")
def model_config(name: str, state: StateDep) -> dict[str, Any]:
    return _config(name, _served(state, name, None).info)


@router.get("/models/{name}/versions/{version}/config")
def version_config(name: str, version: str, state: StateDep) -> dict[str, Any]:
    return _config(name, _served(state, name, version).info)


@router.post("/models/{name}/infer", openapi_extra=_INFER_OPENAPI)
async def infer(name: str, request: Request, state: StateDep) -> Response:
    return await _infer_route(request, state, name, None)


@router.post("/models/{name}/versions/{version}/infer", openapi_extra=_INFER_OPENAPI)
async def version_infer(name: str, version: str, request: Request, state: StateDep) -> Response:
    return await _infer_route(request, state, name, version)


_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


@router.api_route("", methods=[m for m in _METHODS if m != "GET"], include_in_schema=False)
@router.api_route("/{rest:path}", methods=_METHODS, include_in_schema=False)
def unmatched(request: Request) -> Response:
    """Any other /v2 path or method: 404 or 405 as ``{"error": ...}``."""
    allowed = sorted(
        {
            method
            for route in router.routes
            if isinstance(route, APIRoute)
            and route.endpoint is not unmatched
            and route.matches(request.scope)[0] is Match.PARTIAL
            for method in route.methods or ()
        }
    )
    if allowed:
        raise V2Error(
            f"{request.method} is not allowed on {request.url.path}; use {', '.join(allowed)}",
            405,
            allow=", ".join(allowed),
        )
    raise V2Error(f"no V2 endpoint at {request.url.path}", 404)
