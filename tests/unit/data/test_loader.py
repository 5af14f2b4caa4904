"""The streaming loader: disjoint and complete per rank and worker, seeded, resumable, cached."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from gpuyard.data import IngestOptions, ingest, load_recipe, transform
from gpuyard.data.cache import ShardCache
from gpuyard.data.dataset import DatasetVersion
from gpuyard.data.loader import LoaderConfig, ShardDataset, ShardLoader
from gpuyard.data.loader_config import POSITION_KEY, topology
from gpuyard.errors import ConfigError

pytestmark = pytest.mark.unit
N = 1000


@pytest.fixture
def ids_version(gpuyard_home: Path, tmp_path: Path) -> DatasetVersion:
    """1000 rows (id, 6x6 image, label) in about 9 shards."""
    rng = np.random.default_rng(0)
    path = tmp_path / "ids.npz"
    np.savez(
        path, id=np.arange(N), image=rng.integers(0, 255, (N, 6, 6), dtype=np.uint8), label=np.arange(N) % 4
    )
    return ingest(path, "ids", IngestOptions(shard_bytes=5000))


def _ids(batches: list[dict]) -> list[int]:
    return [int(x) for b in batches for x in b["id"]]


def test_ranks_and_workers_get_disjoint_complete_ranges(ids_version: DatasetVersion) -> None:
    assert len(ids_version.shards) >= 8
    cfg = LoaderConfig(batch_size=32, shuffle_buffer=100, seed=3)
    for world, workers in [(1, 1), (2, 3), (3, 2)]:
        ds = ShardDataset(ids_version, cfg)
        seen = [
            _ids(list(ds.iter_consumer(r, world, w, workers))) for r in range(world) for w in range(workers)
        ]
        flat = [i for part in seen for i in part]
        assert len(flat) == len(set(flat)) == N // world * world  # disjoint; at most world-1 rows left out
        per_rank = [sum(len(seen[r * workers + w]) for w in range(workers)) for r in range(world)]
        assert len(set(per_rank)) == 1  # ranks stay in step under DDP


def test_seeded_shuffle_changes_with_epoch_not_with_rerun(ids_version: DatasetVersion) -> None:
    cfg = LoaderConfig(batch_size=50, shuffle_buffer=200, seed=1)
    first = _ids(list(ShardLoader(ids_version, cfg)))
    assert sorted(first) == list(range(N)) and first != list(range(N))
    assert _ids(list(ShardLoader(ids_version, cfg))) == first
    loader = ShardLoader(ids_version, cfg)
    loader.set_epoch(1)
    second = _ids(list(loader))
    assert sorted(second) == list(range(N)) and second != first
    plain = _ids(list(ShardLoader(ids_version, LoaderConfig(batch_size=50, shuffle=False))))
    assert plain == list(range(N))


def test_resume_yields_exactly_the_remaining_batches(ids_version: DatasetVersion) -> None:
    cfg = LoaderConfig(batch_size=24, shuffle_buffer=150, seed=5)
    loader = ShardLoader(ids_version, cfg)
    loader.set_epoch(2)
    full = [b["id"].clone() for b in loader]
    interrupted = ShardLoader(ids_version, cfg)
    interrupted.set_epoch(2)
    it = iter(interrupted)
    head = [next(it)["id"].clone() for _ in range(13)]
    state = interrupted.state_dict()
    assert state["epoch"] == 2 and state["positions"] == {"0": 13 * 24}
    resumed = ShardLoader(ids_version, cfg)
    resumed.load_state_dict(state)
    rest = [b["id"].clone() for b in resumed]
    assert len(head) + len(rest) == len(full) == len(loader)
    assert all(torch.equal(a, b) for a, b in zip(full, head + rest, strict=True))
    other = ShardLoader(ids_version, LoaderConfig(batch_size=25, shuffle_buffer=150, seed=5))
    with pytest.raises(ConfigError, match="batch_size"):
        other.load_state_dict(state)


def test_batches_are_tensors_and_positions_are_reported(ids_version: DatasetVersion) -> None:
    ds = ShardDataset(ids_version, LoaderConfig(batch_size=64, columns=("image", "label")))
    batch = next(iter(ds))
    assert batch["image"].dtype == torch.uint8 and batch["image"].shape == (64, 6, 6)
    assert batch["label"].dtype == torch.int64 and set(batch) == {"image", "label", POSITION_KEY}
    assert batch[POSITION_KEY].tolist() == [0, 64, 0]
    with pytest.raises(ConfigError, match="nope"):
        ShardDataset(ids_version, LoaderConfig(columns=("nope",)))


def test_split_filter_and_seeded_augmentation(ids_version: DatasetVersion) -> None:
    recipe = load_recipe(
        "split: {seed: 0}\naugment: {column: image, hflip: 1.0, rotate: 20, brightness: 0.3}"
    )
    out = transform("ids", recipe, engine="serial")
    train = set(out.to_numpy(["id"], split="train")["id"].tolist())
    cfg = LoaderConfig(batch_size=40, split="train", seed=9)
    batches = list(ShardLoader(out, cfg))
    assert set(_ids(batches)) == train
    again = list(ShardLoader(out, cfg))
    assert all(torch.equal(a["image"], b["image"]) for a, b in zip(batches, again, strict=True))
    raw = {
        int(i): img
        for b in ShardLoader(out, LoaderConfig(batch_size=40, split="train", augment=False))
        for i, img in zip(b["id"], b["image"], strict=True)
    }
    changed = sum(
        not torch.equal(raw[int(i)], img) for b in batches for i, img in zip(b["id"], b["image"], strict=True)
    )
    assert changed > len(train) * 0.9 and batches[0]["image"].dtype == torch.uint8
    flips = ShardLoader(out, LoaderConfig(batch_size=40, split="train"))
    flips.dataset._augment = flips.dataset._augment.model_copy(update={"rotate": 0.0, "brightness": 0.0})  # type: ignore[union-attr]
    for b in flips:
        for i, img in zip(b["id"], b["image"], strict=True):
            assert torch.equal(img, raw[int(i)].flip(-1))


def test_remote_store_reads_through_a_bounded_cache(
    gpuyard_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPUYARD_ARTIFACTS", f"memory://gy-cache-{tmp_path.name}")
    path = tmp_path / "r.npz"
    np.savez(path, id=np.arange(600), x=np.ones((600, 10, 10), dtype=np.uint8))
    v = ingest(path, "remote", IngestOptions(shard_bytes=12_000))
    cache = ShardCache(tmp_path / "cache", max_bytes=10**9)
    loader = ShardLoader(v, LoaderConfig(batch_size=100), cache=cache)
    assert len(_ids(list(loader))) == 600 and cache.misses == len(v.shards) and cache.hits == 0
    loader.set_epoch(1)
    assert len(_ids(list(loader))) == 600 and cache.misses == len(v.shards) and cache.hits >= len(v.shards)
    small = ShardCache(tmp_path / "small", max_bytes=2 * v.shards[0].bytes + 10)
    assert sorted(_ids(list(ShardLoader(v, LoaderConfig(batch_size=100), cache=small)))) == list(range(600))
    assert small.used_bytes() <= small.max_bytes


def test_topology_sources(monkeypatch: pytest.MonkeyPatch) -> None:
    assert topology(1, 4) == (1, 4)
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert topology() == (2, 3)
    with pytest.raises(ConfigError):
        topology(3, 3)


def test_corrupt_shard_stops_the_loader_naming_the_file(ids_version: DatasetVersion) -> None:
    from gpuyard.errors import IntegrityError

    victim = Path(ids_version.shard_paths()[2])
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # a flipped byte inside a data page: caught by the page checksum
    victim.write_bytes(bytes(data))
    with pytest.raises(IntegrityError, match=victim.name):
        list(ShardLoader(ids_version, LoaderConfig(batch_size=100, shuffle=False)))


def _gpuyard_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("gpuyard-loader")]


def test_thread_workers_are_disjoint_complete_and_resume_exactly(ids_version: DatasetVersion) -> None:
    cfg = LoaderConfig(batch_size=16, shuffle_buffer=120, seed=6)
    loader = ShardLoader(ids_version, cfg, num_workers=3, worker_mode="thread")
    loader.set_epoch(1)
    full = [b["id"].clone() for b in loader]
    ids = [int(x) for b in full for x in b]
    assert sorted(ids) == list(range(N)) and len(full) == len(loader)
    # Each worker ships several batches at once; stop inside a shipment and resume from the state.
    interrupted = ShardLoader(ids_version, cfg, num_workers=3, worker_mode="thread")
    interrupted.set_epoch(1)
    it = iter(interrupted)
    head = [next(it)["id"].clone() for _ in range(7)]
    state = interrupted.state_dict()
    it.close()  # an abandoned epoch stops its threads
    assert _gpuyard_threads() == []
    resumed = ShardLoader(ids_version, cfg, num_workers=3, worker_mode="thread")
    resumed.load_state_dict(state)
    rest = [b["id"].clone() for b in resumed]
    assert all(torch.equal(a, b) for a, b in zip(full, head + rest, strict=True)) and len(head + rest) == len(
        full
    )
    with pytest.raises(ConfigError, match="worker_mode"):
        ShardLoader(ids_version, cfg, worker_mode="fiber")


def test_thread_workers_raise_a_corrupt_shard_in_the_consumer(ids_version: DatasetVersion) -> None:
    from gpuyard.errors import IntegrityError

    victim = Path(ids_version.shard_paths()[4])
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    loader = ShardLoader(ids_version, LoaderConfig(batch_size=10), num_workers=2, worker_mode="thread")
    with pytest.raises(IntegrityError, match=victim.name):
        list(loader)
    assert _gpuyard_threads() == []


def test_memory_while_streaming_does_not_grow_with_the_dataset(
    gpuyard_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pyarrow as pa

    # Small row groups and shards, so that a 4x larger dataset has 4x as many of each.
    monkeypatch.setattr("gpuyard.data.shards.ROW_GROUP_BYTES", 8_000)
    rng = np.random.default_rng(2)
    peaks, sizes = [], []
    for n in (6000, 24000):
        path = tmp_path / f"m{n}.npz"
        np.savez(path, id=np.arange(n), image=rng.integers(0, 255, (n, 8, 8), dtype=np.uint8))
        v = ingest(path, f"m{n}", IngestOptions(shard_bytes=40_000))
        cfg = LoaderConfig(batch_size=50, shuffle_buffer=400)
        loader = ShardLoader(v, cfg, num_workers=2, worker_mode="thread")
        base, peak, seen = pa.total_allocated_bytes(), 0, 0
        for batch in loader:
            # Decoded Parquet lives in Arrow's pool; NumPy blocks are bounded by shuffle_buffer by design.
            peak = max(peak, pa.total_allocated_bytes() - base)
            seen += len(batch["id"])
        assert seen == n
        peaks.append(peak)
        sizes.append(n * (64 + 8))
    assert peaks[1] < 2 * peaks[0]  # 4x the rows, not 4x the memory
    assert peaks[1] < sizes[1] / 4  # and far less than the dataset


def test_without_workers_batches_are_those_a_dataloader_hands_over(
    gpuyard_home: Path, tmp_path: Path
) -> None:
    """``num_workers=0`` iterates the dataset itself (no DataLoader), converting as DataLoader does:
    a text column stays a list of str, a list column's rows become tensors; a one-block epoch reads
    in the consumer's thread and starts no prefetch thread."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from torch.utils.data import DataLoader

    rows = 300
    table = pa.table(
        {
            "id": np.arange(rows),
            "text": [f"row {i}" for i in range(rows)],
            "tags": [list(range(i % 4)) for i in range(rows)],
        }
    )
    pq.write_table(table, tmp_path / "t.parquet")
    version = ingest(tmp_path / "t.parquet", "texts", IngestOptions(shard_bytes=3000))
    for cfg in (LoaderConfig(batch_size=32, shuffle_buffer=70, seed=2), LoaderConfig(batch_size=32, seed=2)):
        ours = list(ShardLoader(version, cfg))
        ds = ShardDataset(version, cfg)
        ds.rank, ds.world_size = 0, 1
        theirs = list(DataLoader(ds, batch_size=None))
        assert len(ours) == len(theirs) == -(-rows // 32)
        for a, b in zip(ours, theirs, strict=True):
            b.pop(POSITION_KEY)
            assert set(a) == set(b) == {"id", "text", "tags"}
            assert torch.equal(a["id"], b["id"]) and a["text"] == b["text"]
            assert all(isinstance(t, str) for t in a["text"])
            assert all(isinstance(t, torch.Tensor) for t in a["tags"])
            assert [t.tolist() for t in a["tags"]] == [t.tolist() for t in b["tags"]]
    import threading

    def prefetch_threads() -> set[threading.Thread]:
        return {t for t in threading.enumerate() if t.name.startswith("gpuyard-prefetch")}

    before = prefetch_threads()  # earlier loaders' idle threads may still be exiting: only new ones count
    it = iter(ShardLoader(version, LoaderConfig(batch_size=32, seed=2)))  # 300 rows: one block
    next(it)
    assert prefetch_threads() - before == set()
    it.close()
    it = iter(ShardLoader(version, LoaderConfig(batch_size=32, shuffle_buffer=70, seed=2)))
    next(it)  # five blocks: the next one is read ahead in a thread
    assert len(prefetch_threads() - before) == 1
    it.close()


def test_thread_workers_decode_a_row_group_their_ranges_share_once(
    ids_version: DatasetVersion, monkeypatch: pytest.MonkeyPatch
) -> None:
    import collections
    import threading

    import pyarrow.parquet as pq

    cfg = LoaderConfig(batch_size=16, shuffle_buffer=120, seed=6)
    ds = ShardDataset(ids_version, cfg)
    ds.set_epoch(1)
    shards = [{s for s, _ in ds.consumer_range(0, 1, k, 3)} for k in range(3)]
    assert shards[0] & shards[1] and shards[1] & shards[2]  # two ranges end inside one shard each
    decoded: collections.Counter[int] = collections.Counter()  # by the first id of the row group
    lock = threading.Lock()
    read = pq.ParquetFile.read_row_group

    def counted(self: pq.ParquetFile, i: int, *args: object, **kwargs: object) -> object:
        table = read(self, i, *args, **kwargs)
        with lock:
            decoded[int(table.column("id")[0].as_py())] += 1
        return table

    monkeypatch.setattr(pq.ParquetFile, "read_row_group", counted)
    loader = ShardLoader(ids_version, cfg, num_workers=3, worker_mode="thread")
    loader.set_epoch(1)
    ids = [int(x) for b in loader for x in b["id"]]
    assert sorted(ids) == list(range(N))
    groups = sum(ds._file(i).num_row_groups for i in range(len(ids_version.shards)))
    assert sum(decoded.values()) == groups and set(decoded.values()) == {1}


def test_a_page_corrupted_after_the_hash_check_stops_thread_workers_sharing_row_groups(
    ids_version: DatasetVersion,
) -> None:
    """The SHA-256 is checked once per process while the file's identity holds (inode, size, times);
    a page that changes later without any of them changing (the storage corrupting it: nothing a
    write through the file system can do, since it moves the change time) is caught by its checksum,
    in whichever worker decodes the shared row group, and the workers waiting for it raise too (no
    hang, no thread left)."""
    from gpuyard.data.cache import mark_verified
    from gpuyard.errors import IntegrityError

    cfg = LoaderConfig(batch_size=16, shuffle_buffer=120, seed=6)
    loader = ShardLoader(ids_version, cfg, num_workers=3, worker_mode="thread")
    assert sorted(int(x) for b in loader for x in b["id"]) == list(range(N))  # hashes every shard
    for shard, path in zip(ids_version.shards, ids_version.shard_paths(), strict=True):
        data = bytearray(Path(path).read_bytes())
        data[len(data) // 2] ^= 0xFF
        with open(path, "r+b") as fh:
            fh.write(bytes(data))
        mark_verified(path, shard.sha256)  # as if no stat showed the change: only the pages can tell
    loader.set_epoch(1)
    with pytest.raises(IntegrityError, match="is truncated or corrupt"):
        list(loader)
    assert _gpuyard_threads() == []
