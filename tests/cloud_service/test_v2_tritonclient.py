"""The verifier's V2 endpoints through Triton's own HTTP client, in JSON and binary modes.

A uvicorn server in a thread serves the app on a loopback socket bound here; the teacher
is a tiny demo model with three named classes, and every answer is checked against
onnxruntime on the same frames. Requests no V2 client would send go through httpx.
"""

from __future__ import annotations

import gzip
import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import onnxruntime as ort
import pytest
import tritonclient.http as triton
import uvicorn
from tritonclient.utils import InferenceServerException

from cloud_service.api import create_app
from cloud_service.api.routes import v2
from cloud_service.api.routes.v2 import reading as v2_reading
from cloud_service.demo_teacher import build_demo_teacher
from cloud_service.settings import CloudSettings
from shared.broker import free_port

SIZE = 16
LABELS = ["circle", "square", "triangle"]
MODEL = "teacher"


class _Server(uvicorn.Server):
    """A uvicorn server that says when it has started."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.started_event = threading.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.started_event.set()


@dataclass
class Served:
    address: str  # host:port, as tritonclient takes it
    teacher: ort.InferenceSession
    version: str

    def scores(self, frames: np.ndarray) -> np.ndarray:
        (out,) = self.teacher.run(["scores"], {"frames": frames})
        return np.asarray(out)


@contextmanager
def _serving(root: Path, teacher: Path) -> Iterator[str]:
    """The cloud API over ``teacher`` on a loopback port; its host:port."""
    settings = CloudSettings(
        data_dir=root / "data",
        database_url=f"sqlite:///{root / 'api.db'}",
        teacher_model=teacher,
        # The answers are compared with onnxruntime on the CPU, whatever the host has.
        ort_providers=["CPUExecutionProvider"],
        blob_fsync=False,
        rollout_tick_s=0,
        # No broker is listening here: nothing may reach a shared broker.
        mqtt_url=f"mqtt://127.0.0.1:{free_port()}",
        # One client sends every request here: the upload rate limit is not under test.
        rate_limit_upload_per_min=0,
    )
    app = create_app(settings)
    # The socket is bound and listening before the server starts: no port race, and a
    # client that connects early waits in the backlog.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    server = _Server(uvicorn.Config(app, log_level="warning", lifespan="on", ws="none"))
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [sock]}, name="v2-api", daemon=True
    )
    thread.start()
    try:
        if not server.started_event.wait(30):
            raise RuntimeError("the API server did not start")
        yield f"127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    root = tmp_path_factory.mktemp("v2-tritonclient")
    teacher = build_demo_teacher(
        root / "teacher.onnx", size=SIZE, classes=len(LABELS), hidden=32, seed=3, labels=LABELS
    )
    session = ort.InferenceSession(str(teacher), providers=["CPUExecutionProvider"])
    with _serving(root, teacher) as address:
        yield Served(address, session, "demo-3")


@pytest.fixture(scope="module")
def client(served: Served) -> Iterator[triton.InferenceServerClient]:
    triton_client = triton.InferenceServerClient(served.address, network_timeout=60)
    yield triton_client
    triton_client.close()


@pytest.fixture
def http(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=f"http://{served.address}", timeout=60) as raw:
        yield raw


def _frames(n: int = 2, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, SIZE, SIZE, 3), dtype=np.uint8)


def _input(frames: np.ndarray, *, binary: bool) -> triton.InferInput:
    tensor = triton.InferInput("frames", list(frames.shape), "UINT8")
    tensor.set_data_from_numpy(frames, binary_data=binary)
    return tensor


# --- through tritonclient ---------------------------------------------------------


def test_server_health_and_metadata(client: triton.InferenceServerClient) -> None:
    assert client.is_server_live()
    assert client.is_server_ready()
    meta = client.get_server_metadata()
    assert meta["name"] == "edgeloop" and meta["version"]
    assert {"binary_tensor_data", "classification", "model_configuration"} <= set(
        meta["extensions"]
    )


def test_model_metadata_config_and_readiness(
    client: triton.InferenceServerClient, served: Served
) -> None:
    meta = client.get_model_metadata(MODEL)
    assert meta["name"] == MODEL and meta["versions"] == [served.version]
    assert meta["platform"] == "onnxruntime_onnx"
    assert meta["inputs"] == [{"name": "frames", "datatype": "UINT8", "shape": [-1, SIZE, SIZE, 3]}]
    assert meta["outputs"] == [{"name": "scores", "datatype": "FP32", "shape": [-1, len(LABELS)]}]
    assert meta["parameters"]["labels"] == LABELS
    assert client.get_model_metadata(MODEL, model_version=served.version)["name"] == MODEL
    config = client.get_model_config(MODEL)
    assert config["name"] == MODEL and config["platform"] == "onnxruntime_onnx"
    assert config["max_batch_size"] == v2.MAX_ELEMENTS // (SIZE * SIZE * 3)
    assert config["input"] == [
        {
            "name": "frames",
            "data_type": "TYPE_UINT8",
            "format": "FORMAT_NHWC",
            "dims": [SIZE, SIZE, 3],
        }
    ]
    assert config["output"] == [{"name": "scores", "data_type": "TYPE_FP32", "dims": [len(LABELS)]}]
    assert client.get_model_config(MODEL, model_version=served.version) == config
    assert client.is_model_ready(MODEL)
    assert client.is_model_ready(MODEL, model_version=served.version)
    assert not client.is_model_ready(MODEL, model_version="9")
    assert not client.is_model_ready("student")


@pytest.mark.parametrize("binary_in", [True, False], ids=["binary-in", "json-in"])
@pytest.mark.parametrize("binary_out", [True, False], ids=["binary-out", "json-out"])
def test_infer_matches_onnxruntime(
    client: triton.InferenceServerClient, served: Served, binary_in: bool, binary_out: bool
) -> None:
    frames = _frames(3, seed=int(binary_in) * 2 + int(binary_out))
    result = client.infer(
        MODEL,
        [_input(frames, binary=binary_in)],
        outputs=[triton.InferRequestedOutput("scores", binary_data=binary_out)],
        request_id="req-7",
    )
    response = result.get_response()
    assert response["id"] == "req-7" and response["model_name"] == MODEL
    assert response["model_version"] == served.version
    (output,) = response["outputs"]
    assert output["datatype"] == "FP32" and output["shape"] == [3, len(LABELS)]
    assert ("data" in output) is not binary_out
    scores = result.as_numpy("scores")
    assert scores is not None and scores.dtype == np.float32
    np.testing.assert_allclose(scores, served.scores(frames), rtol=1e-6, atol=1e-7)


def test_infer_without_outputs_answers_all_in_binary(
    client: triton.InferenceServerClient, served: Served
) -> None:
    frames = _frames(1, seed=5)
    result = client.infer(MODEL, [_input(frames, binary=True)], model_version=served.version)
    (output,) = result.get_response()["outputs"]
    assert output["parameters"]["binary_data_size"] == len(LABELS) * 4
    np.testing.assert_allclose(result.as_numpy("scores"), served.scores(frames), rtol=1e-6)


@pytest.mark.parametrize("binary_out", [True, False], ids=["binary-out", "json-out"])
def test_classification_answers_top_classes_by_name(
    client: triton.InferenceServerClient, served: Served, binary_out: bool
) -> None:
    frames = _frames(2, seed=6)
    result = client.infer(
        MODEL,
        [_input(frames, binary=True)],
        outputs=[triton.InferRequestedOutput("scores", binary_data=binary_out, class_count=2)],
    )
    classes = result.as_numpy("scores")
    assert classes is not None and classes.shape == (2, 2)
    expected = served.scores(frames)
    for row, answers in zip(expected, classes, strict=True):
        top = np.argsort(-row)[:2]
        parsed = [(a if isinstance(a, bytes) else a.encode()).decode().split(":") for a in answers]
        assert [int(index) for _, index, _ in parsed] == top.tolist()
        assert [label for _, _, label in parsed] == [LABELS[i] for i in top]
        np.testing.assert_allclose([float(s) for s, _, _ in parsed], row[top], atol=1e-6)


def test_compressed_request_and_response(
    client: triton.InferenceServerClient, served: Served
) -> None:
    frames = _frames(2, seed=7)
    for request_coding, response_coding in [("gzip", "deflate"), ("deflate", "gzip")]:
        result = client.infer(
            MODEL,
            [_input(frames, binary=True)],
            request_compression_algorithm=request_coding,
            response_compression_algorithm=response_coding,
        )
        np.testing.assert_allclose(result.as_numpy("scores"), served.scores(frames), rtol=1e-6)


@pytest.mark.parametrize(
    ("call", "status", "words"),
    [
        (lambda c: c.get_model_metadata("student"), "404", "'student' is not served"),
        (lambda c: c.get_model_config("student"), "404", "'student' is not served"),
        (lambda c: c.get_model_metadata(MODEL, model_version="9"), "404", "no version '9'"),
        (
            lambda c: c.infer("student", [_input(_frames(1), binary=True)]),
            "404",
            "'student' is not served",
        ),
        (
            lambda c: c.infer(MODEL, [_input(_frames(1), binary=True)], model_version="9"),
            "404",
            "no version '9'",
        ),
        (
            lambda c: c.infer(MODEL, [_float_input()]),
            "400",
            "is FP32; the model takes UINT8",
        ),
        (
            lambda c: c.infer(
                MODEL, [_input(np.zeros((1, SIZE, SIZE + 1, 3), np.uint8), binary=True)]
            ),
            "400",
            f"the model takes [N, {SIZE}, {SIZE}, 3]",
        ),
        (
            lambda c: c.infer(
                MODEL,
                [_input(_frames(1), binary=False)],
                outputs=[triton.InferRequestedOutput("logits")],
            ),
            "400",
            "the model has one output, 'scores'",
        ),
    ],
    ids=[
        "metadata-unknown-model",
        "config-unknown-model",
        "unknown-version",
        "infer-unknown-model",
        "infer-unknown-version",
        "wrong-datatype",
        "wrong-shape",
        "unknown-output",
    ],
)
def test_errors_reach_the_client_with_their_message(
    client: triton.InferenceServerClient, call: Any, status: str, words: str
) -> None:
    with pytest.raises(InferenceServerException) as caught:
        call(client)
    assert caught.value.status() == status
    assert words in (caught.value.message() or "")


def _float_input() -> triton.InferInput:
    tensor = triton.InferInput("frames", [1, SIZE, SIZE, 3], "FP32")
    tensor.set_data_from_numpy(np.zeros((1, SIZE, SIZE, 3), np.float32), binary_data=True)
    return tensor


# --- requests no V2 client sends ----------------------------------------------------


def _json_request(frames: np.ndarray) -> dict[str, Any]:
    return {
        "id": "plain",
        "inputs": [
            {
                "name": "frames",
                "shape": list(frames.shape),
                "datatype": "UINT8",
                "data": frames.tolist(),  # nested, as the protocol allows
            }
        ],
    }


@pytest.mark.parametrize("content_type", [None, "text/plain", "application/octet-stream"])
def test_infer_reads_json_whatever_the_content_type(
    http: httpx.Client, served: Served, content_type: str | None
) -> None:
    frames = _frames(1, seed=8)
    headers = {"Content-Type": content_type} if content_type else {}
    answer = http.post(
        f"/v2/models/{MODEL}/infer",
        content=json.dumps(_json_request(frames)).encode(),
        headers=headers,
    )
    assert answer.status_code == 200, answer.text
    (output,) = answer.json()["outputs"]
    scores = np.asarray(output["data"], np.float32).reshape(output["shape"])
    np.testing.assert_allclose(scores, served.scores(frames), rtol=1e-6)


def _binary_body(
    shape: list[int], data: bytes, *, declared: int | None = None
) -> tuple[bytes, int]:
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "frames",
                    "shape": shape,
                    "datatype": "UINT8",
                    "parameters": {"binary_data_size": len(data) if declared is None else declared},
                }
            ]
        }
    ).encode()
    return header + data, len(header)


def _bad_requests() -> list[tuple[str, bytes, dict[str, Any], int, str]]:
    one = _frames(1).tobytes()
    huge, huge_len = _binary_body([2**52 + 1, SIZE, SIZE, 3], one)
    short, short_len = _binary_body([2, SIZE, SIZE, 3], one)
    past, past_len = _binary_body([1, SIZE, SIZE, 3], one, declared=len(one) + 5)
    extra, extra_len = _binary_body([1, SIZE, SIZE, 3], one)
    length = "Inference-Header-Content-Length"
    return [
        ("huge-shape", huge, {length: str(huge_len)}, 400, "over the limit"),
        ("size-mismatch", short, {length: str(short_len)}, 400, "does not fit shape"),
        ("size-past-body", past, {length: str(past_len)}, 400, "runs past"),
        ("trailing-bytes", extra + b"xx", {length: str(extra_len)}, 400, "2 bytes past"),
        ("header-beyond-body", extra, {length: str(len(extra) + 1)}, 400, "not a length"),
        # Latin-1 "²" passes str.isdigit() but not int().
        ("superscript-length", extra, {length: "²".encode("latin-1")}, 400, "not a length"),
        ("binary-without-header", extra, {}, 400, "not JSON"),
        ("not-json", b"{frames", {}, 400, "not JSON"),
        ("no-inputs", b'{"inputs": []}', {}, 400, "inputs"),
        (
            "float-shape",
            b'{"inputs": [{"name": "frames", "shape": [1.5], "datatype": "UINT8"}]}',
            {},
            400,
            "shape",
        ),
        (
            "unknown-datatype",
            b'{"inputs": [{"name": "frames", "shape": [1], "datatype": "UINT9", "data": [1]}]}',
            {},
            400,
            "not a V2 datatype",
        ),
        (
            "values-over-255",
            json.dumps(
                {
                    "inputs": [
                        {
                            "name": "frames",
                            "shape": [1, SIZE, SIZE, 3],
                            "datatype": "UINT8",
                            "data": [256] * (SIZE * SIZE * 3),
                        }
                    ]
                }
            ).encode(),
            {},
            400,
            "integers 0-255",
        ),
        (
            "ragged-data",
            json.dumps(
                {
                    "inputs": [
                        {
                            "name": "frames",
                            "shape": [1, SIZE, SIZE, 3],
                            "datatype": "UINT8",
                            "data": [[1, 2], [3]],
                        }
                    ]
                }
            ).encode(),
            {},
            400,
            "not a regular array",
        ),
        ("deep-json", b"[" * 100_000 + b"]" * 100_000, {}, 400, "not JSON"),
        ("unknown-encoding", b"{}", {"Content-Encoding": "br"}, 415, "not accepted"),
        (
            "truncated-gzip",
            gzip.compress(b'{"inputs": []}')[:-6],
            {"Content-Encoding": "gzip"},
            400,
            "truncated",
        ),
    ]


@pytest.mark.parametrize(
    ("body", "headers", "status", "words"),
    [case[1:] for case in _bad_requests()],
    ids=[case[0] for case in _bad_requests()],
)
def test_bad_infer_requests_answer_4xx_with_an_error(
    http: httpx.Client, body: bytes, headers: dict[str, Any], status: int, words: str
) -> None:
    answer = http.post(f"/v2/models/{MODEL}/infer", content=body, headers=headers)
    assert answer.status_code == status, answer.text
    assert words in answer.json()["error"]


def test_body_over_the_limit_is_413(http: httpx.Client, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(v2_reading, "MAX_BODY_BYTES", 1000)
    answer = http.post(f"/v2/models/{MODEL}/infer", content=b" " * 1001)
    assert answer.status_code == 413 and "over the limit" in answer.json()["error"]
    packed = gzip.compress(b" " * 5000)
    answer = http.post(
        f"/v2/models/{MODEL}/infer", content=packed, headers={"Content-Encoding": "gzip"}
    )
    assert answer.status_code == 413 and "decompressed" in answer.json()["error"]


@pytest.mark.parametrize(
    ("method", "path", "status", "words"),
    [
        ("GET", "/v2/nothing", 404, "no V2 endpoint"),
        ("GET", "/v2/models/teacher/versions/demo-3/stats", 404, "no V2 endpoint"),
        ("GET", "/v2/models/student/ready", 404, "'student' is not served"),
        ("POST", "/v2", 405, "use GET"),
        ("DELETE", "/v2/models/teacher", 405, "use GET"),
        ("GET", "/v2/models/teacher/infer", 405, "use POST"),
    ],
)
def test_every_v2_error_is_an_error_object(
    http: httpx.Client, method: str, path: str, status: int, words: str
) -> None:
    answer = http.request(method, path)
    assert answer.status_code == status
    body = answer.json()
    assert list(body) == ["error"] and words in body["error"]
    if status == 405:
        assert answer.headers["Allow"]


def test_server_metadata_over_plain_http(http: httpx.Client) -> None:
    assert http.get("/v2").json()["extensions"] == list(v2.EXTENSIONS)
    assert http.get("/v2/health/live").json() == {"live": True}
    assert http.get("/v2/health/ready").json() == {"ready": True}


def test_openapi_documents_the_infer_body(http: httpx.Client) -> None:
    spec = http.get("/openapi.json").json()
    body = spec["paths"]["/v2/models/{name}/infer"]["post"]["requestBody"]["content"]
    assert "$ref" not in json.dumps(body)
    assert body["application/json"]["schema"]["properties"]["inputs"]["type"] == "array"


def test_a_teacher_that_cannot_load_answers_503_and_not_ready(tmp_path: Path) -> None:
    with _serving(tmp_path, tmp_path / "missing.onnx") as address:
        unloaded = triton.InferenceServerClient(address)
        try:
            assert unloaded.is_server_live()
            assert not unloaded.is_server_ready()
            assert not unloaded.is_model_ready(MODEL)
            with pytest.raises(InferenceServerException) as caught:
                unloaded.infer(MODEL, [_input(_frames(1), binary=True)])
        finally:
            unloaded.close()
    assert caught.value.status() == "503"
    assert "not loaded" in (caught.value.message() or "")
    assert "does not exist" in (caught.value.message() or "")
