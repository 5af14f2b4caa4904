"""What checking shards against the catalog's SHA-256 costs when a version is read.

One version (default 2,000,000 rows: 16 float32 features, an int64 id and a label; 32 MiB shards) is
read whole, shard by shard, three ways, each round in this order and interleaved:

- ``plain``: each shard file parsed by pyarrow from its path, no hash (the read before issue 28).
- ``verified``: ``DatasetVersion.iter_tables`` on a process that has not checked the shards yet: each
  shard read once into memory, hashed, and parsed from those bytes (what every first read costs).
- ``checked``: the same once the process has checked them (a later epoch, a second load): a stat
  per shard, then the plain read.

The loader's way in (``shard_location``: hash the file in 1 MiB chunks, then hand out the path) is
timed as ``loader_first`` (a first read: hash, then parse) for comparison, and ``hash_only`` (read
and SHA-256 each file, no parse) shows what the hash alone costs. Rates are on-disk bytes
per second of wall time, medians over rounds; the page cache is warm for every way (the files were
just written), so the figures are the CPU cost of hashing, the worst case for the share it takes.

Usage: python benchmarks/shard_verify.py [--rows N] [--rounds R]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="gpuyard-verify-bench-"))
    os.environ["GPUYARD_HOME"] = str(root / "home")

    import numpy as np
    import pyarrow.parquet as pq

    from gpuyard.data import IngestOptions, ingest
    from gpuyard.data import dataset as dsmod
    from gpuyard.data.dataset import shard_location
    from gpuyard.store import get_artifacts

    rng = np.random.default_rng(0)
    src = root / "src.npz"
    np.savez(src, X=rng.normal(size=(args.rows, 16)).astype(np.float32), y=rng.integers(0, 10, args.rows))
    version = ingest(src, "bench", IngestOptions(label_column="y", shard_bytes=32 << 20))
    artifacts = get_artifacts()
    paths = [artifacts._path(s.key) for s in version.shards]
    size = sum(os.path.getsize(p) for p in paths)

    def plain() -> int:
        return sum(pq.read_table(p, use_threads=False).num_rows for p in paths)

    def verified() -> int:
        dsmod._VERIFIED.clear()
        return sum(t.num_rows for t in version.iter_tables())

    def checked() -> int:
        return sum(t.num_rows for t in version.iter_tables())

    def loader_first() -> int:
        dsmod._VERIFIED.clear()
        n = 0
        for s in version.shards:
            n += pq.read_table(shard_location(artifacts, s, None, version.ref), use_threads=False).num_rows
        return n

    def hash_only() -> int:
        import hashlib

        for p in paths:
            hashlib.sha256(Path(p).read_bytes()).hexdigest()
        return args.rows

    ways = {
        "hash_only": hash_only,
        "plain": plain,
        "verified": verified,
        "checked": checked,
        "loader_first": loader_first,
    }
    secs: dict[str, list[float]] = {k: [] for k in ways}
    for fn in ways.values():
        fn()  # warm-up: page cache, imports
    for _ in range(args.rounds):
        for name, fn in ways.items():
            t0 = time.perf_counter()
            rows = fn()
            secs[name].append(time.perf_counter() - t0)
            assert rows == args.rows, (name, rows)
    med = {k: statistics.median(v) for k, v in secs.items()}
    mbps = {k: size / 1e6 / v for k, v in med.items()}
    for name in ways:
        rounds = ", ".join(f"{x * 1000:.0f}" for x in secs[name])
        print(f"{name:>12}: median {med[name] * 1000:.0f} ms = {mbps[name]:.0f} MB/s (rounds ms: {rounds})")
    cost = (med["verified"] / med["plain"] - 1) * 100
    later = (med["checked"] / med["plain"] - 1) * 100
    loader = (med["loader_first"] / med["plain"] - 1) * 100
    print(
        f"shard_verify: first_read_cost_pct={cost:.0f} later_read_cost_pct={later:.0f} "
        f"loader_first_cost_pct={loader:.0f} plain_MBps={mbps['plain']:.0f} "
        f"verified_MBps={mbps['verified']:.0f} checked_MBps={mbps['checked']:.0f} "
        f"loader_first_MBps={mbps['loader_first']:.0f} sha256_MBps={mbps['hash_only']:.0f} "
        f"bytes={size} shards={len(paths)} rows={args.rows} "
        f"rounds={args.rounds} load_avg={os.getloadavg()[0]:.1f}"
    )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
