"""The local blob store: atomic writes, batches, folders made (and made again) as needed."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from cloud_service.blobs import LocalBlobStore, sample_image_key
from shared.errors import StoreError
from shared.ids import new_sample_id


def keys(n: int, agent: str = "cam-1") -> list[str]:
    return [sample_image_key("fleet", agent, new_sample_id(), "jpeg") for _ in range(n)]


@pytest.mark.parametrize("fsync", [True, False])
def test_put_and_put_many_store_every_blob_and_leave_no_temporary_files(
    tmp_path: Path, fsync: bool
) -> None:
    store = LocalBlobStore(tmp_path / "blobs", fsync=fsync)
    one, *batch = keys(5)
    store.put(one, b"first")
    store.put_many([(key, key.encode()) for key in batch])
    assert store.get(one) == b"first"
    assert all(store.get(key) == key.encode() for key in batch)
    store.put(one, b"replaced")  # a rewrite replaces the blob whole
    assert store.get(one) == b"replaced"
    files = [p.name for p in (tmp_path / "blobs").rglob("*") if p.is_file()]
    assert len(files) == 5
    assert not [name for name in files if name.endswith(".tmp")]
    assert store.fsync is fsync  # a batch does not change how single writes sync


def test_a_folder_removed_behind_the_store_is_made_again(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    first, second = keys(2)
    store.put(first, b"x")
    shutil.rmtree(tmp_path / "blobs" / "samples")  # e.g. a retention job emptied it
    store.put(second, b"y")
    store.put_many([(first, b"z"), (second, b"w")])
    assert (store.get(first), store.get(second)) == (b"z", b"w")


def test_a_write_that_cannot_happen_is_a_store_error(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    key = keys(1)[0]
    blocked = tmp_path / "blobs" / "samples"
    blocked.write_bytes(b"a file where the folder should be")
    with pytest.raises(StoreError, match="cannot write blob"):
        store.put(key, b"x")
    assert not [p for p in (tmp_path / "blobs").rglob("*.tmp")]
    assert os.path.isfile(blocked)
