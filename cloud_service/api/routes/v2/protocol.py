"""The V2 inference request as the protocol defines it, its error, and its OpenAPI form."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from shared.errors import ContractError

__all__ = [
    "DATATYPES",
    "EXTENSIONS",
    "HEADER_LENGTH",
    "INFER_OPENAPI",
    "INPUT_DATATYPE",
    "OUTPUT_DATATYPE",
    "V2Error",
    "V2InferRequest",
    "V2Input",
    "V2InputParameters",
    "V2OutputParameters",
    "V2RequestParameters",
    "V2RequestedOutput",
    "error_summary",
]

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


def error_summary(errors: Any) -> str:
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


INFER_OPENAPI: dict[str, Any] = {
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
