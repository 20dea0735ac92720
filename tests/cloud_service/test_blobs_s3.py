"""The S3-compatible blob store against a local S3 server (moto's, started per module)."""

from __future__ import annotations

import importlib.util
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from sqlalchemy import func, select

from cloud_service import registry
from cloud_service.blobs import BlobStore, LocalBlobStore, open_blob_store, sample_image_key
from cloud_service.blobs_s3 import S3BlobStore, parse_s3_url
from cloud_service.settings import CloudSettings
from shared.broker import free_port
from shared.errors import ConfigError, StoreError

if importlib.util.find_spec("boto3") is None:
    pytest.skip("boto3 is not installed (pip install 'edgeloop[s3]')", allow_module_level=True)
if importlib.util.find_spec("moto") is None or importlib.util.find_spec("flask") is None:
    pytest.skip(
        "moto's S3 server is not installed (pip install 'moto[server]')", allow_module_level=True
    )

KEY_ID, SECRET, REGION = "edgeloop-test", "edgeloop-test-secret", "us-east-1"


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A moto S3 server on a free loopback port, for this module's tests."""
    port = free_port()
    log = tmp_path_factory.mktemp("moto") / "moto.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while not _answers(port):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"moto_server did not start on {port}: {log.read_text()[-2000:]}")
            time.sleep(0.1)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        try:
            process.wait(10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(10)


def _raw_client(endpoint: str) -> Any:
    import boto3

    return boto3.session.Session(
        aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET, region_name=REGION
    ).client("s3", endpoint_url=endpoint)


@pytest.fixture
def bucket(s3_endpoint: str) -> Iterator[str]:
    """An empty bucket of this test's own."""
    name = f"edgeloop-{uuid.uuid4().hex[:12]}"
    client = _raw_client(s3_endpoint)
    client.create_bucket(Bucket=name)
    yield name
    client.close()


@pytest.fixture
def make_store(s3_endpoint: str) -> Iterator[Callable[..., S3BlobStore]]:
    made: list[S3BlobStore] = []

    def make(bucket: str, prefix: str = "", **kwargs: Any) -> S3BlobStore:
        values: dict[str, Any] = {
            "endpoint_url": s3_endpoint,
            "region": REGION,
            "access_key_id": KEY_ID,
            "secret_access_key": SECRET,
            "addressing_style": "path",
        }
        values.update(kwargs)
        store = S3BlobStore(bucket, prefix, **values)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


def test_put_get_exists_delete_round_trip(
    bucket: str, make_store: Callable[..., S3BlobStore]
) -> None:
    store = make_store(bucket, "edgeloop/blobs")
    assert isinstance(store, BlobStore)
    key = sample_image_key("fleet-a", "cam-1", "0190a1b2c3d4e5f60718293a4b5c6d7e", "jpeg")
    assert not store.exists(key)
    store.put(key, b"\xff\xd8 image bytes \x00\x01")
    assert store.exists(key)
    assert store.get(key) == b"\xff\xd8 image bytes \x00\x01"
    store.put(key, b"replaced")  # a redelivered sample overwrites its image
    assert store.get(key) == b"replaced"
    store.delete(key)
    assert not store.exists(key)
    store.delete(key)  # deleting twice is fine, as with a local file
    with pytest.raises(StoreError) as missing:
        store.get(key)
    assert missing.value.reason == "not_found"


def test_keys_live_under_the_prefix_and_bad_keys_are_refused(
    s3_endpoint: str, bucket: str, make_store: Callable[..., S3BlobStore]
) -> None:
    store = make_store(bucket, "/tenant-1/blobs/")
    store.put("models/student/abc.onnx", b"onnx")
    listed = _raw_client(s3_endpoint).list_objects_v2(Bucket=bucket)
    assert [o["Key"] for o in listed["Contents"]] == ["tenant-1/blobs/models/student/abc.onnx"]
    for bad in ("../escape", "/absolute", "a//b", "a/./b", "sp ace", ""):
        with pytest.raises(StoreError):
            store.put(bad, b"x")
        with pytest.raises(StoreError):
            store.put_many([("ok/key", b"x"), (bad, b"y")])
    # The batch with a bad key was refused whole, before any upload.
    assert not store.exists("ok/key")


def test_put_many_stores_the_whole_batch_and_a_second_client_reads_it_at_once(
    bucket: str, make_store: Callable[..., S3BlobStore]
) -> None:
    writer = make_store(bucket, "p", max_concurrency=8)
    items = [
        (f"samples/fleet-a/cam-1/0190a1b2/{i:04d}.jpg", f"image {i}".encode()) for i in range(60)
    ]
    assert writer.put_many(items) == [key for key, _ in items]  # one object per key
    # Offered keys may be another write's (a redelivered sample's): not the batch's own.
    assert not writer.batch(items[:1]).fresh
    # Durable on return: another process's client sees every object immediately.
    reader = make_store(bucket, "p")
    for key, data in items:
        assert reader.get(key) == data
    writer.put_many([])  # nothing to do
    writer.put_many(items[:1])


def test_store_errors_are_typed(
    s3_endpoint: str, bucket: str, make_store: Callable[..., S3BlobStore]
) -> None:
    with pytest.raises(StoreError, match="NoSuchBucket"):
        make_store(f"missing-{uuid.uuid4().hex[:8]}").put("a/b", b"x")
    with pytest.raises(StoreError, match="uploads failed"):
        make_store(f"missing-{uuid.uuid4().hex[:8]}").put_many([("a/b", b"x"), ("a/c", b"y")])
    # Nothing listens on this port: the failure is a StoreError the verifier waits out.
    unreachable = make_store(bucket, endpoint_url=f"http://127.0.0.1:{free_port()}", max_attempts=1)
    with pytest.raises(StoreError):
        unreachable.exists("a/b")
    with pytest.raises(ConfigError, match="both"):
        S3BlobStore(bucket, endpoint_url=s3_endpoint, access_key_id=KEY_ID)


def test_s3_urls_parse_and_settings_refuse_malformed_ones(tmp_path: Path) -> None:
    assert parse_s3_url("s3://bucket") == ("bucket", "")
    assert parse_s3_url("s3://bucket/a/b/") == ("bucket", "a/b")
    for bad in ("http://bucket/a", "s3:///a", "s3://bucket/../a"):
        with pytest.raises(ConfigError):
            parse_s3_url(bad)
    for bad in ("http://bucket", "s3://", "s3://Upper-Case", "s3://b"):
        with pytest.raises(ValidationError):
            CloudSettings(data_dir=tmp_path, blob_url=bad)


def test_settings_pick_the_store(tmp_path: Path, s3_endpoint: str, bucket: str) -> None:
    local = open_blob_store(CloudSettings(data_dir=tmp_path, blob_fsync=False))
    assert isinstance(local, LocalBlobStore)
    assert local.root == tmp_path / "blobs"

    settings = CloudSettings(
        data_dir=tmp_path,
        blob_url=f"s3://{bucket}/edgeloop",
        s3_endpoint_url=s3_endpoint,
        s3_region=REGION,
        s3_access_key_id=KEY_ID,
        s3_secret_access_key=SECRET,  # type: ignore[arg-type]
        s3_addressing_style="path",
    )
    store = open_blob_store(settings)
    try:
        assert isinstance(store, S3BlobStore)
        assert (store.bucket, store.prefix) == (bucket, "edgeloop")
        store.put("models/student/0123.onnx", b"artifact")
        # No local file behind it: the API and the distill worker read artifacts with get().
        assert registry.artifact_path(store, "models/student/0123.onnx") is None
        assert store.get("models/student/0123.onnx") == b"artifact"
        assert SECRET not in repr(store)
    finally:
        store.close()


@pytest.mark.mqtt
@pytest.mark.sql
def test_verifier_stores_images_in_s3(
    make_settings: Callable[..., CloudSettings],
    broker: Any,
    topics: Any,
    tmp_path: Path,
    s3_endpoint: str,
    bucket: str,
) -> None:
    from cloud_service.db.models import Sample, Verdict
    from cloud_service.worker import VerifierWorker
    from tests.cloud_service.conftest import make_envelope, publisher

    settings = make_settings(
        mqtt_url=broker.url,
        topic_prefix=topics.prefix,
        database_url=f"sqlite:///{tmp_path / 's3.db'}",
        verifier_client_id=f"test-verifier-{uuid.uuid4().hex[:8]}",
        mqtt_session_expiry_s=30,
        blob_url=f"s3://{bucket}/verifier",
        s3_endpoint_url=s3_endpoint,
        s3_region=REGION,
        s3_access_key_id=KEY_ID,
        s3_secret_access_key=SECRET,
        s3_addressing_style="path",
    )
    store = open_blob_store(settings)
    assert isinstance(store, S3BlobStore)
    sent: list[str] = []
    try:
        with VerifierWorker(settings, blobs=store) as worker:
            pub = publisher(broker.url, broker.protocol)
            try:
                for i in range(12):
                    header, envelope = make_envelope(fleet="fleet-a", agent="cam-1", priority=i % 8)
                    sent.append(header.sample_id)
                    pub.publish(topics.samples("fleet-a", "cam-1"), envelope, qos=1)
                deadline = time.monotonic() + 30
                while worker.counts["verdicts"] < len(sent) and time.monotonic() < deadline:
                    time.sleep(0.05)
            finally:
                pub.loop_stop()
                pub.disconnect()
            with worker.sessions() as session:
                keys = session.scalars(select(Sample.image_key)).all()
                verdicts = session.scalar(select(func.count()).select_from(Verdict))
        assert verdicts == len(sent)
        assert len(keys) == len(sent)
        for key in keys:
            assert store.get(key)[:2] == b"\xff\xd8"  # the JPEG as the agent sent it
        # The recovery path reads images back from the bucket too.
        assert all(store.exists(key) for key in keys)
    finally:
        store.close()
