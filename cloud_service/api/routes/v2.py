"""The teacher over the Open Inference Protocol (KServe V2), for existing V2 clients.

Only the teacher is served, under ``settings.teacher_name``; the input is the model
contract's ``frames`` (UINT8 [N, H, W, 3]); the output ``scores`` (FP32 [N, C]).
Errors answer ``{"error": "..."}`` as the protocol asks.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from fastapi import APIRouter
from fastapi.responses import JSONResponse

from cloud_service.api.deps import StateDep
from cloud_service.api.schemas import V2InferRequest, V2InferResponse, V2Tensor
from cloud_service.verifier import TeacherModel
from shared.errors import ContractError, EdgeLoopError, ModelError

router = APIRouter(prefix="/v2", tags=["inference (KServe V2)"])

# A request holds at most this many input elements (64 frames of 224x224x3): JSON
# tensors are expensive to parse, and this keeps one request from taking the host.
MAX_ELEMENTS = 64 * 224 * 224 * 3


class V2Error(ContractError):
    reason = "bad_inference_request"


def _error(message: str, code: int) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=code)


def _teacher(state: StateDep, name: str) -> TeacherModel | JSONResponse:
    if name != state.settings.teacher_name:
        return _error(
            f"model {name!r} is not served here; try {state.settings.teacher_name!r}", 404
        )
    teacher = state.teacher()
    if teacher is None:
        return _error(f"model {name!r} is not loaded: {state.teacher_error}", 503)
    return teacher


@router.get("/health/live")
def live() -> dict[str, bool]:
    return {"live": True}


@router.get("/health/ready")
def ready(state: StateDep) -> JSONResponse:
    is_ready = state.teacher() is not None
    return JSONResponse({"ready": is_ready}, status_code=200 if is_ready else 503)


@router.get("/models/{name}", response_model=None)
def metadata(name: str, state: StateDep) -> dict[str, Any] | JSONResponse:
    teacher = _teacher(state, name)
    if isinstance(teacher, JSONResponse):
        return teacher
    info = teacher.info
    h = info.height if info.height is not None else -1
    w = info.width if info.width is not None else -1
    return {
        "name": name,
        "versions": [info.version],
        "platform": "onnxruntime_onnx",
        "inputs": [{"name": info.input_name, "datatype": "UINT8", "shape": [-1, h, w, 3]}],
        "outputs": [
            {"name": info.output_name, "datatype": "FP32", "shape": [-1, len(info.labels)]}
        ],
        "parameters": {"labels": list(info.labels), "provider": info.provider},
    }


@router.get("/models/{name}/ready", response_model=None)
def model_ready(name: str, state: StateDep) -> dict[str, Any] | JSONResponse:
    teacher = _teacher(state, name)
    if isinstance(teacher, JSONResponse):
        return teacher
    return {"name": name, "ready": True}


def _frames(request: V2InferRequest, teacher: TeacherModel) -> np.ndarray:
    info = teacher.info
    if len(request.inputs) != 1:
        raise V2Error(f"send exactly one input, {info.input_name!r}")
    tensor = request.inputs[0]
    if tensor.name != info.input_name:
        raise V2Error(f"unknown input {tensor.name!r}; the model takes {info.input_name!r}")
    if tensor.datatype != "UINT8":
        raise V2Error(f"input datatype {tensor.datatype!r} is not accepted; send UINT8")
    shape = tensor.shape
    if len(shape) != 4 or shape[3] != 3 or any(d < 1 for d in shape):
        raise V2Error(f"input shape {shape} is not accepted; send [N, H, W, 3] with N >= 1")
    if (info.height is not None and shape[1] != info.height) or (
        info.width is not None and shape[2] != info.width
    ):
        raise V2Error(f"input shape {shape}: the model takes [N, {info.height}, {info.width}, 3]")
    count = int(np.prod(shape, dtype=np.int64))
    if count > MAX_ELEMENTS:
        raise V2Error(f"input of {count} elements is over the limit of {MAX_ELEMENTS}")
    data = tensor.data
    if isinstance(data, list) and data and isinstance(data[0], list):
        try:
            data = np.asarray(data, dtype=object).reshape(-1).tolist()
        except ValueError as exc:
            raise V2Error(f"input data is ragged: {exc}") from None
    if not isinstance(data, list) or len(data) != count:
        size = len(data) if isinstance(data, list) else type(data).__name__
        raise V2Error(f"input data holds {size} values; shape {shape} needs {count}")
    if not all(type(v) is int and 0 <= v <= 255 for v in data):
        raise V2Error("UINT8 input data must be integers 0-255")
    return np.asarray(data, dtype=np.uint8).reshape(shape)


@router.post("/models/{name}/infer", response_model=None)
def infer(name: str, request: V2InferRequest, state: StateDep) -> V2InferResponse | JSONResponse:
    teacher = _teacher(state, name)
    if isinstance(teacher, JSONResponse):
        return teacher
    info = teacher.info
    if request.outputs and any(o.name != info.output_name for o in request.outputs):
        return _error(f"the model has one output, {info.output_name!r}", 400)
    try:
        frames = _frames(request, teacher)
        scores = teacher.predict(frames)
    except V2Error as exc:
        return _error(exc.message, 400)
    except ModelError as exc:
        return _error(exc.message, 503)
    except EdgeLoopError as exc:
        return _error(exc.message, 400)
    return V2InferResponse(
        model_name=name,
        model_version=info.version,
        id=request.id,
        outputs=[
            V2Tensor(
                name=info.output_name,
                shape=list(scores.shape),
                datatype="FP32",
                data=scores.reshape(-1).tolist(),
            )
        ],
    )
