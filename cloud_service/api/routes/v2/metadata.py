"""The served teacher as V2 describes it: model metadata, Triton configuration, server version."""

from __future__ import annotations

import json
import math
from importlib import metadata as package_metadata
from typing import Any

from cloud_service.api.routes.v2.protocol import INPUT_DATATYPE, OUTPUT_DATATYPE, V2Error
from cloud_service.api.routes.v2.reading import MAX_ELEMENTS
from cloud_service.verifier import ModelInfo, TeacherModel
from cloud_service.web.state import ApiState
from shared.tasks import DETECTION

__all__ = ["config_document", "metadata_document", "served_teacher", "server_version"]


def served_teacher(state: ApiState, name: str, version: str | None) -> TeacherModel:
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


def _output_dims(info: ModelInfo) -> list[int]:
    """The output's dims after the batch axis: a classifier's scores per class, a
    detector's rows of ``x1, y1, x2, y2, score, class`` (``shared.tasks.detection``)."""
    if info.task == DETECTION.name:
        return [-1, 6]
    return [_output_width(info)]


def metadata_document(name: str, info: ModelInfo) -> dict[str, Any]:
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
                "shape": [-1, *_output_dims(info)],
            }
        ],
        "parameters": {"labels": list(info.labels), "provider": info.provider, "task": info.task},
    }


def config_document(name: str, info: ModelInfo) -> dict[str, Any]:
    """The model as a Triton model configuration (its JSON form)."""
    dims = _input_dims(info)
    if -1 in dims:
        # Frames of any size: no batch bound that holds for every size, so the batch
        # axis is written into the dims (Triton's max_batch_size 0).
        max_batch, input_dims, output_dims = 0, [-1, *dims], [-1, *_output_dims(info)]
    else:
        max_batch, input_dims, output_dims = (
            MAX_ELEMENTS // math.prod(dims),
            dims,
            _output_dims(info),
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


def server_version() -> str:
    try:
        return package_metadata.version("edgeloop")
    except package_metadata.PackageNotFoundError:
        return "unknown"
