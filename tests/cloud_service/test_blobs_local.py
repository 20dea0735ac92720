"""The local blob store: atomic single writes, a batch packed into one file, folders
made (and made again) as needed, packed blobs read, checked and deleted by key."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from cloud_service import blobs as blobs_module
from cloud_service.blobs import LocalBlobStore, sample_image_key
from shared.errors import StoreError
from shared.ids import new_sample_id
from tests.cloud_service.conftest import dead_blob_writer


def keys(n: int, agent: str = "cam-1") -> list[str]:
    return [sample_image_key("fleet", agent, new_sample_id(), "jpeg") for _ in range(n)]


def files(root: Path) -> list[Path]:
    """The blobs and packs under ``root`` (not the writers' locks and markers)."""
    return sorted(p for p in root.rglob("*") if p.is_file() and ".writers" not in p.parts)


def markers(root: Path) -> list[Path]:
    """The unsettled packs' markers under ``root``."""
    return sorted(p for p in (root / "packs" / ".writers").glob("*/*") if p.name != "lock")


@pytest.mark.parametrize("fsync", [True, False])
def test_a_put_is_a_file_and_a_batch_is_one_pack_read_back_by_the_keys_it_gave(
    tmp_path: Path, fsync: bool
) -> None:
    store = LocalBlobStore(tmp_path / "blobs", fsync=fsync)
    one, *offered = keys(5)
    store.put(one, b"first")
    batch = [(key, f"image {i}".encode() * (i + 1)) for i, key in enumerate(offered)]
    stored = store.put_many(batch)
    assert store.get(one) == b"first"
    assert [store.get(key) for key in stored] == [data for _, data in batch]
    assert all(key.startswith("packs/") and key.endswith(".jpg") for key in stored)
    assert not any(store.exists(key) for key in offered)  # read by the keys it gave
    store.put(one, b"replaced")  # a rewrite replaces the blob whole
    assert store.get(one) == b"replaced"
    on_disk = files(tmp_path / "blobs")
    packs = [p for p in on_disk if p.suffix == ".pack"]
    assert len(on_disk) == 2 and len(packs) == 1
    assert packs[0].read_bytes() == b"".join(data for _, data in batch)
    assert store.fsync is fsync


def test_a_batch_names_its_keys_before_it_is_written(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "blobs", fsync=False)
    pending = store.batch([(key, b"x" * 10) for key in keys(3)] + [("artifacts/a.onnx", b"")])
    assert not any(store.exists(key) for key in pending.keys)
    assert pending.fresh  # names no other write uses
    assert pending.keys[-1].endswith("/30-0.onnx")  # an empty blob is a blob too
    pending.write()
    assert [store.get(key) for key in pending.keys] == [b"x" * 10] * 3 + [b""]
    assert store.batch([]).keys == []


def test_a_folder_removed_behind_the_store_is_made_again(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    first, second = keys(2)
    store.put(first, b"x")
    store.put_many([(second, b"y")])
    shutil.rmtree(tmp_path / "blobs" / "samples")  # e.g. a retention job emptied them
    shutil.rmtree(tmp_path / "blobs" / "packs")
    store.put(second, b"y")
    packed = store.put_many([(first, b"z"), (second, b"w")])
    assert (store.get(second), [store.get(key) for key in packed]) == (b"y", [b"z", b"w"])


def test_a_write_that_cannot_happen_is_a_store_error_and_leaves_nothing(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    key = keys(1)[0]
    blocked = tmp_path / "blobs" / "samples"
    blocked.write_bytes(b"a file where the folder should be")
    with pytest.raises(StoreError, match="cannot write blob"):
        store.put(key, b"x")
    (tmp_path / "blobs" / "packs").write_bytes(b"a file where the packs should be")
    with pytest.raises(StoreError, match="cannot write blob pack"):
        store.put_many([(key, b"x")])
    assert files(tmp_path / "blobs") == [tmp_path / "blobs" / "packs", blocked]


def test_a_pack_cut_short_while_written_is_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalBlobStore(tmp_path / "blobs")
    calls = []

    def full_disk(fd: int, buffers: list[memoryview]) -> int:
        calls.append(len(buffers))
        if len(calls) > 1:
            raise OSError(28, "No space left on device")
        return os.write(fd, buffers[0][:7])  # a short write, then the disk fills

    monkeypatch.setattr(blobs_module.os, "writev", full_disk)
    pending = store.batch([(key, b"0123456789") for key in keys(2)])
    with pytest.raises(StoreError, match="No space left"):
        pending.write()
    assert not [p for p in files(tmp_path / "blobs") if p.suffix == ".pack"]
    assert markers(tmp_path / "blobs") == []  # nor its marker
    with pytest.raises(StoreError) as missing:
        store.get(pending.keys[0])
    assert missing.value.reason == "not_found"


def test_keys_under_packs_are_the_stores_own_and_forged_ones_read_nothing(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "blobs", fsync=False)
    (real,) = store.put_many([(keys(1)[0], b"0123456789")])
    pack = real.rsplit("/", 1)[0]
    for forged in (real, f"{pack}/0-4.jpg", "packs/x.jpg"):
        with pytest.raises(StoreError, match="packs/"):
            store.put(forged, b"x")
        with pytest.raises(StoreError, match="packs/"):
            store.batch([(forged, b"x")])
    assert store.get(f"{pack}/2-3.jpg") == b"234"  # any range of a pack is its bytes
    with pytest.raises(StoreError, match="cut short"):
        store.get(f"{pack}/8-99999999999.jpg")
    assert not store.exists(f"{pack}/8-3.jpg")
    with pytest.raises(StoreError) as missing:
        store.get(real.replace(".pack/", "0.pack/"))
    assert missing.value.reason == "not_found"
    for escape in ("packs/../../etc/passwd.pack/0-4", "packs/a/../b.pack/0-1.jpg"):
        with pytest.raises(StoreError):
            store.get(escape)


def test_a_packed_blob_is_deleted_alone_and_the_pack_goes_with_its_last(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "blobs", fsync=False)
    data = [bytes([i]) * 9000 for i in range(3)]
    stored = store.put_many([(key, d) for key, d in zip(keys(3), data, strict=True)])
    store.delete(stored[1])
    store.delete(stored[1])  # deleting twice is fine, as with a file
    assert not store.exists(stored[1])
    with pytest.raises(StoreError) as missing:
        store.get(stored[1])
    assert missing.value.reason == "not_found"
    assert [store.get(stored[0]), store.get(stored[2])] == [data[0], data[2]]
    store.delete(stored[0])
    store.delete(stored[2])
    assert files(tmp_path / "blobs") == []
    store.delete(stored[0])  # its pack is gone: nothing to do


def test_a_pack_stays_while_any_of_its_bytes_is_not_deleted(tmp_path: Path) -> None:
    store = LocalBlobStore(tmp_path / "blobs", fsync=False)
    first, second = store.put_many([(key, b"0123456789") for key in keys(2)])
    pack = first.rsplit("/", 1)[0]
    for overlapping in (f"{pack}/0-6.jpg", f"{pack}/4-6.jpg", f"{pack}/2-8.jpg"):
        store.delete(overlapping)  # 16 of the pack's 20 bytes, 10 of them counted twice
    assert store.get(second) == b"0123456789"
    store.delete(second)
    assert files(tmp_path / "blobs") == []


def test_a_dead_writers_unsettled_pack_loses_what_nothing_points_at(tmp_path: Path) -> None:
    root = tmp_path / "blobs"
    first, settled, nothing = dead_blob_writer(
        root, [["aaaa", "bbbbbb", "cc", "dddd"], ["e"], ["ff"]], settled={1}
    )
    assert len(markers(root)) == 2  # the settled batch left none
    sweeper = LocalBlobStore(root, fsync=False)
    asked: list[str] = []

    def referenced(prefix: str) -> list[str]:
        asked.append(prefix)
        return [first[1], first[3]] if first[0].startswith(prefix) else []

    swept = sweeper.sweep_abandoned(referenced, older_than_s=0)
    assert sorted(asked) == sorted(k[0].rsplit("/", 1)[0] + "/" for k in (first, nothing))
    assert swept.batches == 2 and swept.bytes_kept == 10 and swept.bytes_deleted == 4 + 2 + 2
    assert [sweeper.exists(k) for k in first] == [False, True, False, True]
    assert [sweeper.get(first[1]), sweeper.get(first[3])] == [b"bbbbbb", b"dddd"]
    assert not sweeper.exists(nothing[0])  # nothing pointed at it: the pack is gone
    assert sweeper.get(settled[0]) == b"e"  # settled: never looked at
    packs = sorted(p.name for p in files(root) if p.suffix == ".pack")
    assert packs == sorted(k[0].split("/")[-2] for k in (first, settled))
    assert not (root / "packs" / ".writers").exists() or not any(
        (root / "packs" / ".writers").iterdir()
    )  # the dead writer's folder went with its last marker
    assert sweeper.sweep_abandoned(referenced, older_than_s=0).batches == 0


def test_a_live_writers_packs_and_young_markers_are_left_alone(tmp_path: Path) -> None:
    root = tmp_path / "blobs"
    writer = LocalBlobStore(root, fsync=False)
    pending = writer.batch([(key, b"x" * 5) for key in keys(2)])
    pending.write()  # its rows have not committed yet
    sweeper = LocalBlobStore(root, fsync=False)
    assert sweeper.sweep_abandoned(lambda prefix: [], older_than_s=0).batches == 0
    assert writer.sweep_abandoned(lambda prefix: [], older_than_s=0).batches == 0  # its own
    assert all(writer.exists(key) for key in pending.keys)
    writer.close()  # gone now, as a process that died; its marker is still young
    assert sweeper.sweep_abandoned(lambda prefix: [], older_than_s=3600).batches == 0
    assert len(markers(root)) == 1
    swept = sweeper.sweep_abandoned(lambda prefix: [], older_than_s=0)
    assert swept.batches == 1 and swept.bytes_deleted == 10
    assert files(root) == [] and markers(root) == []


def test_a_settled_batch_leaves_no_marker(tmp_path: Path) -> None:
    root = tmp_path / "blobs"
    store = LocalBlobStore(root, fsync=False)
    store.put_many([(key, b"x") for key in keys(2)])  # written and settled at once
    batch = store.batch([(key, b"y") for key in keys(2)])
    batch.write()
    assert len(markers(root)) == 1
    batch.settle()
    batch.settle()  # twice is fine
    assert markers(root) == []
    store.close()  # nothing unsettled: its writer folder goes
    assert not any((root / "packs" / ".writers").iterdir())
    store.put_many([(key, b"z") for key in keys(1)])  # writing again makes a new one
    assert len(list((root / "packs" / ".writers").iterdir())) == 1
