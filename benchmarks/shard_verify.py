"""What checking shards against the catalog's SHA-256 costs when a version is read.

One version (default 2,000,000 rows: 16 float32 features, an int64 id and a label; 32 MiB shards) is
read whole, shard by shard, by every way below; every way reads the same shard files from the same
warm page cache, one thread, and the order of the ways rotates each round:

- ``plain``: each shard file parsed by ``pq.read_table`` from its path, no hash, pyarrow's default of
  not verifying Parquet page checksums (what a plain pyarrow user's read costs).
- ``page_checksums``: the same parse with ``page_checksum_verification=True`` (a CRC32 of every data
  page, as gpuyard's shards are written and read), no SHA-256: what the checksums alone cost.
- ``verified``: ``DatasetVersion.iter_tables`` on a process that has not checked the shards yet: each
  shard read once into memory, hashed, and parsed from those bytes (what every first read costs).
- ``checked``: the same once the process has checked them (a later epoch, a second load): a stat
  per shard, then the read with page checksums verified.

The loader's way in (``shard_location``: hash the file in 1 MiB chunks, then hand out the path) is
timed as ``loader_first`` (a first read: hash, then parse) for comparison, and ``hash_only`` (read
and SHA-256 each file, no parse) shows what the hash alone costs. Rates are on-disk bytes
per second of wall time, medians over rounds; the page cache is warm for every way (the files were
just written), so the figures are the CPU cost of hashing, the worst case for the share it takes.
``later_read_cost_pct`` (checked against plain) splits into ``page_checksum_cost_pct``
(page_checksums against plain) and ``stat_cost_pct`` (checked against page_checksums).

Usage: python benchmarks/shard_verify.py [--quick] [--rows N] [--rounds R]
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
    parser.add_argument("--quick", action="store_true", help="100,000 rows, 2 rounds (a few seconds)")
    parser.add_argument("--smoke", action="store_true", help="CI: 20,000 rows, 1 round (no figure)")
    parser.add_argument("--rows", type=int, default=None, help="rows (default 2,000,000)")
    parser.add_argument("--rounds", type=int, default=None, help="rounds (default 5)")
    args = parser.parse_args()
    args.rows = args.rows or (20_000 if args.smoke else 100_000 if args.quick else 2_000_000)
    args.rounds = args.rounds or (1 if args.smoke else 2 if args.quick else 5)
    root = Path(tempfile.mkdtemp(prefix="gpuyard-verify-bench-"))
    os.environ["GPUYARD_HOME"] = str(root / "home")

    import numpy as np
    import pyarrow.parquet as pq

    from gpuyard.data import IngestOptions, ingest
    from gpuyard.data import cache as cachemod
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

    def page_checksums() -> int:
        n = 0
        for p in paths:
            n += pq.ParquetFile(p, page_checksum_verification=True).read(use_threads=False).num_rows
        return n

    def verified() -> int:
        cachemod._VERIFIED.clear()
        return sum(t.num_rows for t in version.iter_tables())

    def checked() -> int:
        return sum(t.num_rows for t in version.iter_tables())

    def loader_first() -> int:
        cachemod._VERIFIED.clear()
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
        "page_checksums": page_checksums,
        "verified": verified,
        "checked": checked,
        "loader_first": loader_first,
    }
    secs: dict[str, list[float]] = {k: [] for k in ways}
    for fn in ways.values():
        fn()  # warm-up: page cache, imports
    names = list(ways)
    for r in range(args.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            fn = ways[name]
            t0 = time.perf_counter()
            rows = fn()
            secs[name].append(time.perf_counter() - t0)
            assert rows == args.rows, (name, rows)
    med = {k: statistics.median(v) for k, v in secs.items()}
    mbps = {k: size / 1e6 / v for k, v in med.items()}
    for name in ways:
        rounds = ", ".join(f"{x * 1000:.0f}" for x in secs[name])
        print(f"{name:>14}: median {med[name] * 1000:.0f} ms = {mbps[name]:.0f} MB/s (rounds ms: {rounds})")
    cost = (med["verified"] / med["plain"] - 1) * 100
    later = (med["checked"] / med["plain"] - 1) * 100
    loader = (med["loader_first"] / med["plain"] - 1) * 100
    checksums = (med["page_checksums"] / med["plain"] - 1) * 100
    stat = (med["checked"] / med["page_checksums"] - 1) * 100
    print(
        f"shard_verify: first_read_cost_pct={cost:.0f} later_read_cost_pct={later:.0f} "
        f"page_checksum_cost_pct={checksums:.0f} stat_cost_pct={stat:.0f} "
        f"loader_first_cost_pct={loader:.0f} plain_MBps={mbps['plain']:.0f} "
        f"page_checksums_MBps={mbps['page_checksums']:.0f} verified_MBps={mbps['verified']:.0f} "
        f"checked_MBps={mbps['checked']:.0f} "
        f"loader_first_MBps={mbps['loader_first']:.0f} sha256_MBps={mbps['hash_only']:.0f} "
        f"bytes={size} shards={len(paths)} rows={args.rows} "
        f"rounds={args.rounds} load_avg={os.getloadavg()[0]:.1f}"
    )
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
