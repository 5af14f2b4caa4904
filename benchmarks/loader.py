"""Loader throughput: gpuyard's shard loader vs the pyarrow loop, NumPy, WebDataset, Ray Data, files.

What is equal: all read the same N samples (28x28 uint8 image + int64 label), shuffled, in batches
of 256 tensors into this process, with the same number of workers, for full epochs, alternated
(order rotated per round); each batch is touched (a sum) so nothing is left lazy. The pyarrow loop
reads the very shard files gpuyard reads; the others read the same samples in their own format.
Baselines, each in its best configuration that we know of, doing the same work:

- pyarrow (the headline for streaming, ``vs_pyarrow``): the loop a competent user writes for
  Parquet records, over gpuyard's own shard files (:class:`PyarrowEpochs`): row groups shuffled
  per epoch, read with ``read_row_group``, rows permuted in blocks of 16,384 (gpuyard's shuffle
  buffer), batches as tensor views; run in the main process and in 2 DataLoader worker processes,
  the faster of the two in each round counts. pyarrow's default read verifies nothing; gpuyard
  verifies every data page's CRC32 on each read (and a shard's SHA-256 on a process's first read),
  so the same loop with ``page_checksum_verification=True`` in the main process
  (``pyarrow_checked``, ``vs_pyarrow_checked``) is the baseline doing the same checking.

- numpy (against gpuyard's whole mode, ``whole_vs_numpy``): the same decoded arrays in memory, a
  permutation per epoch, one ``ndarray.take`` per column per batch, wrapped as tensors without a
  copy, one thread: the least a loader over in-memory data can do. Whole mode
  (``LoaderConfig(whole=True)``) decodes the version into memory once, then gathers batches.
- webdataset (streaming): tar shards of about 128 MB (WebDataset's documentation and published
  datasets use 100 MB to 1 GB; at least one shard per worker), records of 64 samples (50 KB: raw
  image bytes and int64 labels, one tar member each; until 2026-11-29 one 784-byte sample per
  record, which measured ``tarfile``'s header parsing), ``shardshuffle``, a ``.shuffle`` buffer of
  16,384 samples' records, 4 records per batch with the batch's rows permuted, inside the workers,
  ``WebLoader`` with ``batch_size=None`` and persistent workers.
- ray_data (streaming, when Ray installs, on epochs of 100,000 samples or more: Ray starts its
  executor every epoch, which dominates a shorter one): Parquet files read by ``read_parquet``
  with the block order randomised, the raw bytes decoded by ``map_batches`` over Arrow batches, a
  local shuffle buffer of 1,000 and ``iter_torch_batches``, Ray started with the same number of
  CPUs as workers.
- files (context, ``vs_files``): one raw 785-byte file per sample (``np.frombuffer``), a map-style
  Dataset with ``shuffle=True``, the default collate, persistent workers.
- MosaicML ``streaming`` is not run: its release (0.13) pins numpy<2.2 and imports torchvision,
  whose wheels for this torch need CUDA libraries; it does not install beside the CPU torch here.

gpuyard streams with thread workers (``worker_mode="thread"``, its best configuration with workers
for small samples; ``vs_best_streaming`` = against the fastest of the pyarrow loops, WebDataset and
Ray Data in each round), in the main process (``num_workers=0``, ``main_vs_pyarrow``) and with
DataLoader worker processes (``proc_vs_files``, ``proc_vs_pyarrow``); all yield the very same
batches. ``vs_pyarrow`` takes the faster of gpuyard's thread workers and main process against the
faster of the pyarrow loop's main process and workers in each round, as each side would be run
(``threads_vs_pyarrow`` and ``main_vs_pyarrow`` give gpuyard's two apart). Every contender is built
and its first ("cold") epoch run; then each round runs one epoch of each in turn, the order rotated
each round, and ratios are per round (median and spread).
Peak memory (PSS of the process and its workers, sampled at the start, every 20 ms and at the end)
is taken afterwards for gpuyard's three modes, each alone.

Usage: python benchmarks/loader.py [--quick] [--samples N] [--workers W] [--rounds R]

``--quick``: 12,000 samples.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch
from torch.utils.data import DataLoader, Dataset

BATCH = 256
# MosaicML streaming 0.13 (the release on PyPI) pins numpy<2.2 and imports torchvision, whose only
# wheels for this torch need CUDA libraries: it does not install beside gpuyard's CPU torch here.
MOSAIC_NOTE = "mosaicml-streaming 0.13 needs numpy<2.2 and a torchvision for this CPU torch"
SHAPE = (28, 28)


class PeakRSS:
    """Samples memory of this process and its children in a thread; ``peak`` is in bytes.

    PSS (proportional set size) where Linux offers it: forked workers share the parent's pages, and
    adding their RSS would count torch's libraries three times.
    """

    def __init__(self) -> None:
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        me = psutil.Process()
        total = 0
        for proc in [me, *me.children(recursive=True)]:
            try:
                info = proc.memory_full_info()
                total += getattr(info, "pss", info.rss)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        self.peak = max(self.peak, total)

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.sample()

    def __enter__(self) -> PeakRSS:
        # One sample here and one at the end: an epoch shorter than the thread's first wakeup (whole
        # mode's 12,000 samples take a few ms) was never sampled and printed 0 MiB.
        self.sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def timed_epoch(
    batches: Iterable[Any], get: Callable[[Any], tuple[torch.Tensor, torch.Tensor]]
) -> tuple[float, int]:
    """(seconds, samples) of one pass over ``batches``."""
    n, check = 0, 0
    t0 = time.perf_counter()
    for batch in batches:
        images, labels = get(batch)
        check += int(images[:, 0, 0].sum()) + int(labels.sum())
        n += len(labels)
    return time.perf_counter() - t0, n


def memory_epoch(batches: Iterable[Any], get: Callable[[Any], tuple[torch.Tensor, torch.Tensor]]) -> int:
    """Peak PSS bytes (process and workers) during one pass over ``batches`` (not timed)."""
    with PeakRSS() as rss:
        timed_epoch(batches, get)
    return rss.peak


class FileDataset(Dataset[tuple[torch.Tensor, int]]):
    """One file per sample: 784 image bytes then one label byte."""

    def __init__(self, files: list[str]) -> None:
        self.files = files

    def __len__(self) -> int:
        return len(self.files)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        with open(self.files[i], "rb") as fh:
            raw = fh.read()
        img = torch.from_numpy(np.frombuffer(raw, dtype=np.uint8, count=784).reshape(SHAPE).copy())
        return img, raw[784]


# Samples per WebDataset record: 64 images (50 KB) and their labels in one tar member each, so tar
# headers and the per-record Python are paid once per 64 samples (a 784-byte sample per record spent
# most of its time in ``tarfile``'s header parsing).
WDS_RECORD = 64


def _wds_record(sample: dict[str, bytes]) -> tuple[np.ndarray, np.ndarray]:
    images = np.frombuffer(sample["img"], dtype=np.uint8).reshape(-1, *SHAPE)
    return images, np.frombuffer(sample["cls"], dtype=np.int64)


def _wds_collate(records: list[tuple[np.ndarray, np.ndarray]]) -> tuple[torch.Tensor, torch.Tensor]:
    """BATCH // WDS_RECORD shuffled records into one batch, its rows permuted."""
    images = np.concatenate([r[0] for r in records])
    labels = np.concatenate([r[1] for r in records])
    perm = np.random.permutation(len(labels))
    return torch.from_numpy(images[perm]), torch.from_numpy(labels[perm])


def make_data(root: Path, n: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 10, n)
    # Digit-like images: mostly dark with a bright blob, so compression behaves as on real data.
    images = np.zeros((n, *SHAPE), dtype=np.uint8)
    ys, xs = np.mgrid[0:28, 0:28]
    for k in range(10):
        cy, cx = 8 + (k % 3) * 6, 8 + (k // 3) * 4
        blob = (255 * np.exp(-((ys - cy) ** 2 + (xs - cx) ** 2) / 30)).astype(np.uint8)
        images[labels == k] = blob
    images = np.clip(images.astype(np.int16) + rng.integers(0, 30, images.shape), 0, 255).astype(np.uint8)
    return images, labels


def setup_files(root: Path, images: np.ndarray, labels: np.ndarray) -> list[str]:
    folder = root / "files"
    folder.mkdir()
    files = []
    for i in range(len(labels)):
        path = folder / f"{i:07d}.bin"
        path.write_bytes(images[i].tobytes() + bytes([int(labels[i])]))
        files.append(str(path))
    return files


# WebDataset's documentation and the datasets published in it use shards of about 100 MB to 1 GB.
WDS_SHARD_BYTES = 128 << 20


def setup_wds(root: Path, images: np.ndarray, labels: np.ndarray, workers: int) -> list[str]:
    import webdataset as wds

    folder = root / "wds"
    folder.mkdir()
    # Records of WDS_RECORD samples (rows in a random order, so a record is a random draw), shards of
    # WDS_SHARD_BYTES and at least one per worker so that no worker idles.
    order = np.random.default_rng(1).permutation(len(labels))
    records = -(-len(labels) // WDS_RECORD)
    record_bytes = WDS_RECORD * (784 + 8) + 1024
    per_shard = min(WDS_SHARD_BYTES // record_bytes, -(-records // max(1, workers)))
    with wds.ShardWriter(str(folder / "shard-%05d.tar"), maxcount=per_shard, verbose=0) as sink:
        for r in range(records):
            idx = order[r * WDS_RECORD : (r + 1) * WDS_RECORD]
            sink.write(
                {
                    "__key__": f"{r:07d}",
                    "img": np.ascontiguousarray(images[idx]).tobytes(),
                    "cls": labels[idx].astype(np.int64).tobytes(),
                }
            )
    return sorted(str(p) for p in folder.glob("*.tar"))


def ray_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("ray") is not None and importlib.util.find_spec("ray.data") is not None


def setup_ray(root: Path, images: np.ndarray, labels: np.ndarray) -> str:
    """The samples as Parquet files for Ray Data: raw image bytes (784 a row) and the label."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = root / "ray"
    folder.mkdir()
    step = 25_000  # four files per 100,000 samples: Ray Data reads one file per task
    for i, lo in enumerate(range(0, len(labels), step)):
        flat = np.ascontiguousarray(images[lo : lo + step]).reshape(-1)
        count = len(flat) // 784
        raw = pa.FixedSizeBinaryArray.from_buffers(pa.binary(784), count, [None, pa.py_buffer(flat)])
        table = pa.table({"image": raw, "label": pa.array(labels[lo : lo + step].astype(np.int64))})
        pq.write_table(table, folder / f"part-{i:03d}.parquet")
    return str(folder)


def _ray_decode(batch: Any) -> dict[str, np.ndarray]:
    """A pyarrow batch of raw rows into arrays (one view of the image bytes, no per-row work)."""
    images = batch.column("image").combine_chunks()
    flat = np.frombuffer(images.buffers()[1], np.uint8, count=len(images) * 784, offset=images.offset * 784)
    return {"image": flat.reshape(-1, *SHAPE), "label": batch.column("label").to_numpy()}


def _arrow_image_batch(table: Any) -> tuple[np.ndarray, np.ndarray]:
    """A table of raw rows (``image`` as 784-byte fixed-size binary, ``label``) as two NumPy arrays,
    zero-copy: one view of the image column's data buffer."""
    images = table.column("image").combine_chunks()
    flat = np.frombuffer(images.buffers()[1], np.uint8, count=len(images) * 784, offset=images.offset * 784)
    return flat.reshape(-1, *SHAPE), table.column("label").to_numpy()


class PyarrowEpochs(torch.utils.data.IterableDataset):  # type: ignore[type-arg]
    """The loop a competent user writes for Parquet records, over the very shard files gpuyard reads:
    every epoch the (file, row group) pairs are shuffled (seeded by seed and epoch), each DataLoader
    worker takes every ``num_workers``-th pair, reads it with ``ParquetFile.read_row_group``
    (pyarrow's defaults: no page-checksum verification, which gpuyard's reads do; ``checked``
    turns it on), and the rows are
    permuted in blocks of ``buffer`` rows (gpuyard's default shuffle buffer) and cut into batches of
    256 as tensors (no copy). Run in the main process (``PyarrowEpochs`` iterated directly) and in
    DataLoader worker processes (``batch_size=None``, persistent workers: each worker counts its own
    epochs)."""

    def __init__(self, paths: list[str], seed: int = 0, buffer: int = 16384, checked: bool = False) -> None:
        import pyarrow.parquet as pq

        self.paths, self.seed, self.buffer, self.epoch, self.checked = paths, seed, buffer, 0, checked
        self.pieces = [(i, g) for i, p in enumerate(paths) for g in range(pq.ParquetFile(p).num_row_groups)]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        import pyarrow.parquet as pq

        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        if info is not None:  # persistent workers keep this copy: count epochs here
            self.epoch += 1
        rng = np.random.default_rng([self.seed, self.epoch])
        order = [self.pieces[i] for i in rng.permutation(len(self.pieces))][worker::workers]
        files = {
            i: pq.ParquetFile(self.paths[i], page_checksum_verification=self.checked)
            for i in {i for i, _ in order}
        }
        images: list[np.ndarray] = []
        labels: list[np.ndarray] = []
        held = 0
        for n, (i, g) in enumerate(order):
            img, lab = _arrow_image_batch(files[i].read_row_group(g, use_threads=False))
            images.append(img)
            labels.append(lab)
            held += len(lab)
            if held < self.buffer and n + 1 < len(order):
                continue
            block_img, block_lab = np.concatenate(images), np.concatenate(labels)
            perm = rng.permutation(len(block_lab))
            block_img, block_lab = block_img[perm], block_lab[perm]
            cut = len(block_lab) if n + 1 == len(order) else len(block_lab) // BATCH * BATCH
            for lo in range(0, cut, BATCH):
                yield (
                    torch.from_numpy(block_img[lo : lo + BATCH]),
                    torch.from_numpy(block_lab[lo : lo + BATCH]),
                )
            images, labels = [block_img[cut:]], [block_lab[cut:]]
            held = len(block_lab) - cut


class NumpyEpochs:
    """The in-memory baseline of whole mode: the decoded arrays, a permutation per epoch, a ``take``
    per column per batch, wrapped as tensors (no copy), in one thread."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, seed: int = 0) -> None:
        self.images, self.labels, self.seed, self.epoch = images, labels, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = np.random.default_rng([self.seed, self.epoch]).permutation(len(self.labels))
        for lo in range(0, len(order), BATCH):
            idx = order[lo : lo + BATCH]
            # The method, not np.take: it skips the function's Python wrapper (as gpuyard's whole mode).
            yield torch.from_numpy(self.images.take(idx, axis=0)), torch.from_numpy(self.labels.take(idx))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="12,000 samples instead of 100,000")
    ap.add_argument("--samples", type=int, default=None)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="timed epochs per contender, interleaved")
    ap.add_argument("--smoke", action="store_true", help="CI: 2,000 samples, one round (no figure)")
    args = ap.parse_args()
    if args.smoke:
        args.samples, args.rounds = args.samples or 2000, 1
    n = args.samples or (12_000 if args.quick else 100_000)
    w = args.workers
    root = Path(tempfile.mkdtemp(prefix="gpuyard-bench-loader-"))
    os.environ["GPUYARD_HOME"] = str(root / "home")
    os.environ.pop("GPUYARD_DATABASE_URL", None)
    os.environ.pop("GPUYARD_ARTIFACTS", None)
    import webdataset as wds

    from gpuyard.data import ingest
    from gpuyard.data.loader import LoaderConfig, ShardLoader

    images, labels = make_data(root, n)
    np.savez(root / "src.npz", image=images, label=labels)
    t0 = time.perf_counter()
    version = ingest(root / "src.npz", "bench")
    print(f"ingest {n} samples: {time.perf_counter() - t0:.2f} s, {len(version.shards)} shard(s)")
    files = setup_files(root, images, labels)
    tars = setup_wds(root, images, labels, w)
    # Ray Data starts its executor every epoch (25-45 s here under load): below 100,000 samples an
    # epoch measures that start, not reading, so Ray runs only on epochs of 100,000 samples or more.
    ray_path = setup_ray(root, images, labels) if ray_available() and n >= 100_000 else None
    decoded = (images.copy(), labels.astype(np.int64))  # the NumPy baseline's data, decoded in memory
    del images

    def make_gpuyard(mode: str, whole: bool = False, workers: int = w) -> Callable[[], Any]:
        def make() -> Any:
            cfg = LoaderConfig(batch_size=BATCH, columns=("image", "label"), whole=whole)
            return ShardLoader(version, cfg, num_workers=workers, persistent_workers=True, worker_mode=mode)

        return make

    def make_files() -> Any:
        return DataLoader(
            FileDataset(files), batch_size=BATCH, shuffle=True, num_workers=w, persistent_workers=True
        )

    def make_wds() -> Any:
        pipeline = wds.WebDataset(tars, shardshuffle=len(tars), nodesplitter=None, empty_check=False)
        # A buffer of 16,384 samples' records (gpuyard's shuffle buffer), BATCH // WDS_RECORD
        # records per batch, the batch's rows permuted.
        pipeline = pipeline.shuffle(16384 // WDS_RECORD).map(_wds_record)
        pipeline = pipeline.batched(BATCH // WDS_RECORD, collation_fn=_wds_collate)
        return wds.WebLoader(pipeline, batch_size=None, num_workers=w, persistent_workers=True)

    def make_numpy() -> Any:
        return NumpyEpochs(*decoded)

    shard_paths = version.shard_paths()  # the files gpuyard reads (checked here, outside any timing)

    def make_pyarrow() -> Any:
        return PyarrowEpochs(shard_paths)

    def make_pyarrow_checked() -> Any:
        return PyarrowEpochs(shard_paths, checked=True)

    def make_pyarrow_workers() -> Any:
        return DataLoader(PyarrowEpochs(shard_paths), batch_size=None, num_workers=w, persistent_workers=True)

    class RayEpochs:
        """Ray Data over the Parquet files, its documented training idiom: block order randomised,
        the raw bytes decoded by ``map_batches`` (Arrow batches, no per-row Python), a local
        shuffle buffer, ``iter_torch_batches``; Ray started with ``w`` CPUs."""

        def __init__(self) -> None:
            import ray

            if not ray.is_initialized():
                ray.init(num_cpus=w, include_dashboard=False, log_to_driver=False, configure_logging=False)
            ctx = ray.data.DataContext.get_current()
            ctx.enable_progress_bars = False
            ctx.print_on_execution_start = False
            ds = ray.data.read_parquet(ray_path).randomize_block_order()
            self.ds = ds.map_batches(_ray_decode, batch_format="pyarrow", batch_size=4096)

        def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
            return iter(self.ds.iter_torch_batches(batch_size=BATCH, local_shuffle_buffer_size=1000))

    contenders: list[tuple[str, Callable[[], Any], Callable[[Any], tuple[torch.Tensor, torch.Tensor]]]] = [
        ("gpuyard", make_gpuyard("thread"), lambda b: (b["image"], b["label"])),
        ("gpuyard_proc", make_gpuyard("process"), lambda b: (b["image"], b["label"])),
        ("gpuyard_whole", make_gpuyard("thread", whole=True), lambda b: (b["image"], b["label"])),
        ("gpuyard_main", make_gpuyard("thread", workers=0), lambda b: (b["image"], b["label"])),
        ("numpy", make_numpy, lambda b: (b[0], b[1])),
        ("files", make_files, lambda b: (b[0], b[1])),
        ("webdataset", make_wds, lambda b: (b[0], b[1])),
        ("pyarrow", make_pyarrow, lambda b: (b[0], b[1])),
        ("pyarrow_workers", make_pyarrow_workers, lambda b: (b[0], b[1])),
        ("pyarrow_checked", make_pyarrow_checked, lambda b: (b[0], b[1])),
    ]
    if ray_path is not None:
        contenders.append(("ray_data", RayEpochs, lambda b: (b["image"], b["label"])))
    # Epoch 0 includes starting the workers ("cold"); later epochs reuse them (persistent workers,
    # all of them). Every contender is built first; then each round runs one epoch of each in turn
    # (the order rotated every round), so a busy moment of the shared machine falls on all of them
    # alike. Ratios are taken per round and reported as the median and the spread over the rounds.
    cold: dict[str, tuple[float, int]] = {}
    loaders: dict[str, Any] = {}
    gets = {name: get for name, _, get in contenders}
    not_run = [f"MosaicML streaming ({MOSAIC_NOTE})"]
    if ray_path is None:
        not_run.append(
            f"Ray Data ({'epochs under 100,000 samples' if ray_available() else 'Ray is not installed'})"
        )
    for name, make, get in contenders:
        try:
            loaders[name] = make()
        except Exception as exc:  # Ray's local cluster can fail to start on an overloaded machine
            if name != "ray_data":
                raise
            not_run.append(f"Ray Data ({type(exc).__name__}: {str(exc).splitlines()[0][:120]})")
            continue
        cold[name] = timed_epoch(loaders[name], get)
    names = list(loaders)
    rounds: list[dict[str, float]] = []
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        rates: dict[str, float] = {}
        for name in order:
            if hasattr(loaders[name], "set_epoch"):
                loaders[name].set_epoch(r + 1)
            dt, count = timed_epoch(loaders[name], gets[name])
            rates[name] = count / dt
        rounds.append(rates)
    loaders.clear()  # workers (and Ray) stop before memory is sampled
    if ray_path is not None:
        import ray

        ray.shutdown()  # also after a failed start: it stops what did start
    gc.collect()
    # Peak memory of gpuyard's modes, each alone: a fresh loader, its cold epoch, then one sampled.
    peaks: dict[str, int] = {}
    for name, make, get in contenders[:3]:
        loader = make()
        timed_epoch(loader, get)
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(1)
        peaks[name] = memory_epoch(loader, get)
        del loader
        gc.collect()

    cold_rate = {k: c / dt for k, (dt, c) in cold.items()}
    rate = {k: statistics.median(rd[k] for rd in rounds) for k in names}
    streaming = [k for k in ("webdataset", "ray_data", "pyarrow", "pyarrow_workers") if k in names]
    for k in names:
        all_rates = ", ".join(f"{rd[k]:,.0f}" for rd in rounds)
        print(
            f"{k:>13}: cold epoch (worker start) {cold_rate[k]:,.0f} samples/s; steady median "
            f"{rate[k]:,.0f} samples/s (rounds: {all_rates})"
        )
    for k, peak in peaks.items():
        print(f"{k:>13}: peak PSS {peak / 2**20:.0f} MiB (alone)")
    print(f"dataset in memory would be {n * (784 + 8) / 2**20:.0f} MiB; workers={w}, batch={BATCH}")
    print(f"WebDataset: {len(tars)} shard(s); not run: " + "; ".join(not_run))

    def ratio(a: str | list[str], b: str | list[str]) -> list[float]:
        def best(rd: dict[str, float], x: str | list[str]) -> float:
            return max(rd[k] for k in x) if isinstance(x, list) else rd[x]

        return [best(rd, a) / best(rd, b) for rd in rounds]

    figures = {
        "vs_pyarrow": ratio(["gpuyard", "gpuyard_main"], ["pyarrow", "pyarrow_workers"]),
        "threads_vs_pyarrow": ratio("gpuyard", ["pyarrow", "pyarrow_workers"]),
        "main_vs_pyarrow": ratio("gpuyard_main", ["pyarrow", "pyarrow_workers"]),
        "vs_pyarrow_checked": ratio(["gpuyard", "gpuyard_main"], "pyarrow_checked"),
        "proc_vs_pyarrow": ratio("gpuyard_proc", ["pyarrow", "pyarrow_workers"]),
        "vs_files": ratio("gpuyard", "files"),
        "vs_best_streaming": ratio("gpuyard", streaming),
        "whole_vs_numpy": ratio("gpuyard_whole", "numpy"),
        "vs_webdataset": ratio("gpuyard", "webdataset"),
        "proc_vs_files": ratio("gpuyard_proc", "files"),
        "whole_vs_files": ratio("gpuyard_whole", "files"),
    }
    if "ray_data" in names:
        figures["vs_ray_data"] = ratio("gpuyard", "ray_data")
    best_streaming = [max(streaming, key=lambda x: rd[x]) for rd in rounds]
    print("fastest streaming baseline per round: " + ", ".join(best_streaming))
    for key, values in figures.items():
        print(f"{key}: median {statistics.median(values):.2f}x, rounds {min(values):.2f}-{max(values):.2f}x")
    print(
        "loader: "
        + " ".join(f"{key}={statistics.median(v):.2f}x" for key, v in figures.items())
        + f" whole_vs_numpy_min={min(figures['whole_vs_numpy']):.2f}x "
        f"vs_best_streaming_min={min(figures['vs_best_streaming']):.2f}x "
        f"vs_pyarrow_min={min(figures['vs_pyarrow']):.2f}x vs_pyarrow_max={max(figures['vs_pyarrow']):.2f}x "
        f"cold_vs_files={cold_rate['gpuyard'] / cold_rate['files']:.1f}x "
        + " ".join(f"{k}_samples_s={rate[k]:.0f}" for k in names)
        + " "
        + " ".join(f"{k}_peak_pss_mib={p / 2**20:.0f}" for k, p in peaks.items())
        + f" samples={n} workers={w} rounds={args.rounds} load_avg={os.getloadavg()[0]:.1f}"
    )
    shutil.rmtree(root, ignore_errors=True)  # 100,000 files or 10M rows per run: leave nothing behind


if __name__ == "__main__":
    main()
