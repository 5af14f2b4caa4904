"""Transform throughput: a normalisation + encoding recipe, gpuyard vs pandas, Polars and DuckDB.

Every side starts from the same rows in Parquet and ends with the transformed rows in Parquet, doing
the same work:

- input: the same files. The source is ingested once; every side then reads the version's shard
  files (hard links to gpuyard's blobs, named in shard order, in one folder), the bytes gpuyard's
  transform reads. (Until 2026-11-29 the others read the original source file, which Polars reads
  about a fifth slower than gpuyard's shards: unequal input.)

- statistics: precomputed for every side and read inside the timed section: gpuyard reads them
  from the version's manifest (computed by ``ingest``), the others from a JSON file of the same
  figures (z-score mean/std, min-max min/max, the sorted categories). Computing them is timed on
  no side (ingest's cost is ingest's);
- output, written to the same folder: the four scaled columns as float32, ``id`` as it was, and
  the one-hot as ONE vector column of 20 uint8 per row on every side (gpuyard's representation;
  20 flag columns would be a different, larger output).

Contenders, each in its best idiom, in a fresh process (imports excluded from the timing):

- gpuyard: ``transform(ref, recipe, engine="thread")`` over the ingested version (2 worker threads,
  its best configuration on 2 cores; also ``engine="pool"``, worker processes, ``pool_vs_best``).
  It also writes the output's statistics and records the version: more work than the others do;
- pandas: ``read_parquet`` (pyarrow engine; the category read as a ``Categorical`` straight from
  Parquet's dictionary pages), vectorised float32 arithmetic, the category codes into 20-byte
  vectors (one NumPy gather), written by pyarrow (what ``to_parquet`` calls; pandas has no
  fixed-size vector dtype);
- Polars (all its threads), two idioms, the faster of the two per round counts: ``concat_arr`` of
  the 20 flags (a native ``Array(UInt8, 20)`` column) or the Enum codes into 20-byte vectors;
  ``write_parquet``;
- DuckDB (all its threads): one ``COPY (SELECT ...) TO`` statement, the one-hot an ``array_value``
  of the 20 flags.

What the outputs share (checked on 2026-11-29 with each file's Parquet metadata, 3M rows): snappy
on every side; the one-hot column dictionary-encoded on every side (Polars chooses it for the
binary column itself; gpuyard marks the column as having few values); 49-59 MB of output. What
differs, each side in its own default: Polars and pandas/pyarrow write min/max statistics (gpuyard
does not), gpuyard writes a CRC32 per page, checks the input pages' CRC32 and the input shards'
SHA-256, leaves uncompressed the float columns snappy would not shrink by a third, and delta-encodes
``id``.

``vs_best`` is against the fastest of pandas, Polars and DuckDB in each round (the fastest
configuration of each competitor is the one compared against). Rounds run every contender once, the
order rotated each round; ratios are per round, reported as the median and the spread.
``cpu_vs_best``: the same per CPU-second of the timed section (every thread of the contender's
process; the lowest of the baselines' configurations), which a busy shared machine inflates less
than wall time.

Usage: python benchmarks/transform.py [--quick] [--rows N] [--workers W]

``--engines``: instead, compare the engines a recipe could run on, each in a fresh process over the
same source file with the same fitted statistics: NumPy and Arrow (gpuyard's ``FittedTransform``),
pyarrow.compute kernels alone (``arrow-compute``: subtract, multiply, cast, and a ``take`` of the
one-hot vectors), Polars and DuckDB when installed (``PYTHONPATH`` may point at a folder holding
them). Two figures each: the whole job with the engine's own Parquet reader and writer (one-hot as
k uint8 columns for Polars and DuckDB; one vector column, written with gpuyard's shard settings,
for the other two), and the fitted steps alone on an Arrow table already in memory (Arrow in,
Arrow out). Last line ``engines: ...``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

CATEGORIES = [f"c{i:02d}" for i in range(20)]
RECIPE = {
    "normalize": [
        {"columns": ["a", "b"], "method": "zscore"},
        {"columns": ["c", "d"], "method": "minmax"},
    ],
    "encode": [{"column": "cat", "method": "onehot"}],
}


def make_source(path: Path, rows: int) -> None:
    """Write ``rows`` rows (4 float columns, one 20-value category, an id) in 1M-row groups."""
    rng = np.random.default_rng(0)
    writer = None
    for start in range(0, rows, 1_000_000):
        n = min(1_000_000, rows - start)
        table = pa.table(
            {
                "id": np.arange(start, start + n, dtype=np.int64),
                "a": rng.normal(10, 3, n),
                "b": rng.exponential(2.0, n),
                "c": rng.uniform(-5, 5, n),
                "d": rng.integers(0, 1000, n).astype(np.float64),
                "cat": pa.array(np.array(CATEGORIES)[rng.integers(0, 20, n)]),
            }
        )
        writer = writer or pq.ParquetWriter(path, table.schema)
        writer.write_table(table)
    assert writer is not None
    writer.close()


def _read_fitted(path: Path) -> tuple[dict[str, tuple[float, float]], list[str]]:
    """The precomputed statistics (timed on every side): per column (shift, scale), categories."""
    import json

    fitted = json.loads(path.read_text())
    shifts = {
        c: (p["mean"], p["std"]) if p["method"] == "zscore" else (p["min"], p["max"] - p["min"])
        for c, p in fitted["normalize"].items()
    }
    return shifts, list(fitted["encode"]["cat"]["categories"])


def _onehot_vectors(codes: np.ndarray, k: int) -> pa.Array:
    """One 20-byte vector per row (row ``k`` of the table: unknown, all zeros), as gpuyard stores it."""
    eye = np.zeros((k + 1, k), np.uint8)
    eye[np.arange(k), np.arange(k)] = 1
    codes = np.where(codes < 0, k, codes)
    return pa.FixedSizeBinaryArray.from_buffers(pa.binary(k), len(codes), [None, pa.py_buffer(eye[codes])])


def _clock() -> tuple[float, float]:
    """(wall, CPU of every thread of this process) now: each side's timed section is measured by both."""
    return time.perf_counter(), time.process_time()


def _since(start: tuple[float, float]) -> tuple[float, float]:
    """(wall seconds, CPU seconds) since ``start`` (from :func:`_clock`)."""
    return time.perf_counter() - start[0], time.process_time() - start[1]


def run_pandas(src: Path, dest: Path, stats: Path) -> tuple[float, float]:
    import pandas as pd

    # Modules read_parquet and to_parquet import on their first call (Arrow's dataset and filesystem
    # layers, the pandas conversion): imports, excluded from the timing as gpuyard's are.
    for module in ("pandas.io.parquet", "pyarrow.dataset", "pyarrow.pandas_compat", "pyarrow.parquet"):
        importlib.import_module(module)

    t0 = _clock()
    shifts, cats = _read_fitted(stats)
    df = pd.read_parquet(src, engine="pyarrow", read_dictionary=["cat"])  # the folder of shards
    for col, (shift, scale) in shifts.items():
        df[col] = ((df[col] - shift) * (1.0 / (scale or 1.0))).astype(np.float32)
    codes = df["cat"].cat.set_categories(cats).cat.codes.to_numpy()
    # One vector column, as gpuyard writes: pandas has no fixed-size vector dtype, so the column is
    # built in Arrow and written with pyarrow (what to_parquet calls).
    table = pa.Table.from_pandas(df.drop(columns=["cat"]), preserve_index=False)
    pq.write_table(table.append_column("cat", _onehot_vectors(codes, len(cats))), dest)
    return _since(t0)


def run_polars(src: Path, dest: Path, stats: Path, idiom: str) -> tuple[float, float]:
    """Polars, all its threads; ``idiom``: ``array`` (``concat_arr`` of the 20 flags: a native
    ``Array(UInt8, 20)`` column) or ``binary`` (the category's physical code turned into one 20-byte
    vector, as pandas' side does)."""
    import polars as pl

    t0 = _clock()
    shifts, cats = _read_fitted(stats)
    frame = pl.read_parquet(src / "*.parquet")
    scaled = [
        ((pl.col(c) - s) * (1.0 / (k or 1.0))).cast(pl.Float32).alias(c) for c, (s, k) in shifts.items()
    ]
    if idiom == "array":
        onehot = pl.concat_arr([(pl.col("cat") == v).fill_null(False).cast(pl.UInt8) for v in cats]).alias(
            "cat"
        )
        frame = frame.with_columns([*scaled, onehot])
    else:
        codes = frame["cat"].cast(pl.Enum(cats)).to_physical().fill_null(-1).to_numpy()
        vectors = pl.from_arrow(_onehot_vectors(codes.astype(np.int64), len(cats)))
        frame = frame.with_columns(scaled).with_columns(vectors.alias("cat"))
    frame.write_parquet(dest, compression="snappy")
    return _since(t0)


def run_duckdb(src: Path, dest: Path, stats: Path) -> tuple[float, float]:
    """DuckDB, all its threads: one SQL statement, the one-hot an ``array_value`` of 20 flags."""
    import duckdb

    con = duckdb.connect()
    t0 = _clock()
    shifts, cats = _read_fitted(stats)
    exprs = ", ".join(
        f'CAST(("{c}" - {s!r}) * {1.0 / (k or 1.0)!r} AS FLOAT) AS "{c}"' for c, (s, k) in shifts.items()
    )
    flags = ", ".join(f"CAST(coalesce(cat = '{v}', false) AS UTINYINT)" for v in cats)
    query = f"SELECT id, {exprs}, array_value({flags}) AS cat FROM read_parquet('{src}/*.parquet')"
    con.sql(f"COPY ({query}) TO '{dest}' (FORMAT parquet, COMPRESSION snappy)")
    return _since(t0)


def run_gpuyard(engine: str, workers: int, source_ref: str, pandas_out: Path) -> tuple[float, float, int]:
    """(seconds, CPU seconds of this process, peak RSS KiB of the transform itself: driver or largest
    worker, before the check). The CPU leaves out the pool's worker processes (``engine="thread"``:
    none)."""
    # pyarrow imports pandas (when installed) on its first NumPy conversion, and the first catalog
    # access imports the SQLite driver and fsspec's local files: imports, excluded from the timing as
    # the pandas side's own imports are (opening the catalog and everything after it is timed).
    for module in ("sqlite3", "sqlalchemy.dialects.sqlite", "fsspec.implementations.local"):
        importlib.import_module(module)
    from gpuyard.data import load_recipe, transform
    from gpuyard.store import get_artifacts

    pa.array(np.zeros(1))
    t0 = _clock()
    result = transform(source_ref, load_recipe(RECIPE), engine=engine, workers=workers, output="bench-out")
    dt, cpu = _since(t0)
    peak = _peak_kib()
    # Same answer as pandas: compare a slice of the two outputs.
    mine = next(result.iter_tables(["id", "a", "d", "cat"]))
    from gpuyard.data.columns import tensor_spec, tensor_to_numpy

    spec = tensor_spec(mine.schema.field("cat"))
    assert spec is not None and spec.shape == (len(CATEGORIES),)
    n = min(mine.num_rows, 100_000)
    theirs = pq.read_table(pandas_out, columns=["id", "a", "d", "cat"]).slice(0, n)
    np.testing.assert_array_equal(mine.column("id").to_numpy()[:n], theirs.column("id").to_numpy())
    for col in ("a", "d"):
        np.testing.assert_allclose(
            mine.column(col).to_numpy()[:n], theirs.column(col).to_numpy(), rtol=1e-4, atol=1e-5
        )
    onehot = tensor_to_numpy(mine.column("cat"), spec)[:n]
    their_onehot = np.frombuffer(theirs.column("cat").combine_chunks().buffers()[1], np.uint8)
    np.testing.assert_array_equal(onehot, their_onehot[: n * len(CATEGORIES)].reshape(n, -1))
    # Shards are content-addressed: a later round would find them stored and skip the writes. Remove
    # them so every round writes its output, as pandas does.
    for shard in result.shards:
        get_artifacts().delete(shard.key)
    return dt, cpu, peak


def _peak_kib() -> int:
    """Peak RSS so far of this process or of its largest finished child (KiB).

    This process's own from ``VmHWM`` (its address space's high-water mark): Linux carries
    ``ru_maxrss`` across ``exec``, so ``RUSAGE_SELF`` would start at the benchmark driver's RSS
    (about 625 MiB after making the data) and every contender would read at least that.
    """
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    try:
        status = Path("/proc/self/status").read_text()
        own = next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:"))
    except (OSError, StopIteration):
        own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return max(own, kids)


def _fitted(src: Path) -> dict[str, Any]:
    """The recipe's statistics over every row of ``src`` (as a transform without a split fits them)."""
    import pyarrow.compute as pc

    table = pq.read_table(src, columns=["a", "b", "c", "d"])
    fitted: dict[str, Any] = {"normalize": {}, "encode": {}}
    for col in ("a", "b"):
        v = table.column(col).to_numpy()
        fitted["normalize"][col] = {"method": "zscore", "mean": float(v.mean()), "std": float(v.std())}
    for col in ("c", "d"):
        lo_hi = pc.min_max(table.column(col))
        lo, hi = lo_hi["min"].as_py(), lo_hi["max"].as_py()
        fitted["normalize"][col] = {"method": "minmax", "min": lo, "max": hi}
    fitted["encode"]["cat"] = {"method": "onehot", "categories": CATEGORIES}
    return fitted


def run_engine(engine: str, part: str, src: Path, dest: Path, fitted: dict[str, Any]) -> float:
    """Seconds of one engine's whole job (``part="job"``) or of its fitted steps alone (``"steps"``)."""
    norm = fitted["normalize"]
    shifts = {
        c: (p["mean"], p["std"]) if p["method"] == "zscore" else (p["min"], p["max"] - p["min"])
        for c, p in norm.items()
    }
    table = pq.read_table(src, read_dictionary=["cat"]) if part == "steps" else None
    pa.array(np.zeros(1))  # pyarrow's lazy pandas import, outside the timing
    if engine == "numpy-arrow":
        from gpuyard.data import load_recipe
        from gpuyard.data.fitted import FittedTransform
        from gpuyard.data.shards import encode_shard

        ft = FittedTransform(load_recipe(RECIPE), fitted)
        t0 = time.perf_counter()
        if part == "steps":
            ft.finish(table)
        else:
            dest.write_bytes(encode_shard(ft.finish(pq.read_table(src, read_dictionary=["cat"]))))
        return time.perf_counter() - t0
    if engine == "arrow-compute":
        import pyarrow.compute as pc

        from gpuyard.data.columns import TensorSpec, tensor_field
        from gpuyard.data.shards import encode_shard

        k = len(CATEGORIES)
        eye = np.zeros((k + 1, k), np.uint8)
        eye[np.arange(k), np.arange(k)] = 1  # row k: unknown, all zeros
        vectors = pa.FixedSizeBinaryArray.from_buffers(pa.binary(k), k + 1, [None, pa.py_buffer(eye)])
        cats = pa.array(CATEGORIES)

        def arrow_steps(t: pa.Table) -> pa.Table:
            for c, (s, scale) in shifts.items():
                scaled = pc.cast(pc.multiply(pc.subtract(t[c], s), 1.0 / (scale or 1.0)), pa.float32())
                t = t.set_column(t.schema.get_field_index(c), c, scaled)
            rows = []  # per chunk: the dictionary's entries looked up once, then taken by index
            for chunk in t["cat"].chunks:
                lookup = pc.fill_null(pc.index_in(chunk.dictionary, value_set=cats), k)
                rows.append(pc.take(vectors, pc.take(lookup, chunk.indices)))
            field = tensor_field("cat", TensorSpec(dtype="uint8", shape=(k,)))
            return t.set_column(t.schema.get_field_index("cat"), field, pa.chunked_array(rows, field.type))

        t0 = time.perf_counter()
        if part == "steps":
            arrow_steps(table)
        else:
            dest.write_bytes(encode_shard(arrow_steps(pq.read_table(src, read_dictionary=["cat"]))))
        return time.perf_counter() - t0
    if engine == "polars":
        import polars as pl

        def steps(frame: Any) -> Any:
            cols = [
                ((pl.col(c) - s) * (1.0 / (k or 1.0))).cast(pl.Float32).alias(c)
                for c, (s, k) in shifts.items()
            ]
            dummies = [(pl.col("cat") == v).cast(pl.UInt8).alias(f"cat={v}") for v in CATEGORIES]
            return frame.with_columns(cols + dummies).drop("cat")

        t0 = time.perf_counter()
        if part == "steps":
            steps(pl.from_arrow(table)).to_arrow()
        else:
            steps(pl.read_parquet(src)).write_parquet(dest, compression="snappy")
        return time.perf_counter() - t0
    if engine == "duckdb":
        import duckdb

        exprs = ", ".join(
            f'CAST(("{c}" - {s!r}) * {1.0 / (k or 1.0)!r} AS FLOAT) AS "{c}"' for c, (s, k) in shifts.items()
        )
        dummies = ", ".join(f"CAST(cat = '{v}' AS UTINYINT) AS \"cat={v}\"" for v in CATEGORIES)
        con = duckdb.connect()
        t0 = time.perf_counter()
        if part == "steps":
            con.register("t", table)
            con.sql(f"SELECT id, {exprs}, {dummies} FROM t").fetch_arrow_table()
        else:
            query = f"SELECT id, {exprs}, {dummies} FROM read_parquet('{src}')"
            con.sql(f"COPY ({query}) TO '{dest}' (FORMAT parquet, COMPRESSION snappy)")
        return time.perf_counter() - t0
    raise ValueError(engine)


def compare_engines(rows: int, rounds: int) -> None:
    import importlib.util
    import json

    root = Path(tempfile.mkdtemp(prefix="gpuyard-bench-engines-"))
    src = root / "src.parquet"
    make_source(src, rows)
    fitted = json.dumps(_fitted(src))
    engines = ["numpy-arrow", "arrow-compute"] + [
        e for e in ("polars", "duckdb") if importlib.util.find_spec(e)
    ]
    best: dict[tuple[str, str], tuple[float, float]] = {}
    for _ in range(rounds):
        for engine in engines:
            for part in ("job", "steps"):
                sec, peak, _cpu = _spawn(
                    "--child", f"engine-{engine}-{part}", str(src), str(root / "out"), fitted
                )
                old = best.get((engine, part))
                best[(engine, part)] = (sec, peak) if old is None else (min(old[0], sec), max(old[1], peak))
    versions = {e: __import__(e).__version__ for e in engines if e in ("polars", "duckdb")}
    for engine in engines:
        (job, job_rss), (steps, _) = best[(engine, "job")], best[(engine, "steps")]
        print(f"{engine:>12}: whole job {job:.2f} s (peak RSS {job_rss / 1024:.0f} MiB), steps {steps:.3f} s")
    print(
        "engines: "
        + " ".join(
            f"{e}_job_s={best[(e, 'job')][0]:.2f} {e}_steps_s={best[(e, 'steps')][0]:.3f}" for e in engines
        )
        + f" rows={rows} rounds={rounds} "
        + " ".join(f"{e}={v}" for e, v in versions.items())
        + f" load_avg={os.getloadavg()[0]:.1f}"
    )
    shutil.rmtree(root, ignore_errors=True)


def child(which: str, argv: list[str]) -> None:
    """Run one contender in this (fresh) process; print seconds, peak RSS (KiB, self and children)
    and CPU seconds: of the timed section for the contenders (every thread of this process), of the
    whole process (imports included) for ``--engines``."""
    if which == "pandas":
        dt, cpu = run_pandas(Path(argv[0]), Path(argv[1]), Path(argv[2]))
        peak = _peak_kib()
    elif which.startswith("polars-"):
        dt, cpu = run_polars(Path(argv[0]), Path(argv[1]), Path(argv[2]), which.split("-", 1)[1])
        peak = _peak_kib()
    elif which == "duckdb":
        dt, cpu = run_duckdb(Path(argv[0]), Path(argv[1]), Path(argv[2]))
        peak = _peak_kib()
    elif which.startswith("engine-"):
        import json

        engine, part = which.split("-", 1)[1].rsplit("-", 1)
        dt = run_engine(engine, part, Path(argv[0]), Path(argv[1]), json.loads(argv[2]))
        peak = _peak_kib()
        me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime
    else:
        dt, cpu, peak = run_gpuyard(which.split("-")[1], int(argv[0]), argv[1], Path(argv[2]))
    print(f"{dt} {peak} {cpu}")


def _spawn(*argv: str) -> tuple[float, float, float]:
    """(wall seconds, peak RSS KiB, CPU seconds: see :func:`child`) of one child run."""
    out = subprocess.run([sys.executable, __file__, *argv], check=True, capture_output=True, text=True)
    seconds, peak_kib, cpu = (float(x) for x in out.stdout.split()[-3:])
    return seconds, peak_kib, cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 million rows instead of 10 million")
    ap.add_argument("--rows", type=int, default=None)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="runs per contender (median and spread)")
    ap.add_argument("--smoke", action="store_true", help="CI: 20,000 rows, one round (no figure)")
    ap.add_argument(
        "--engines",
        action="store_true",
        help="compare NumPy/Arrow, pyarrow.compute, Polars and DuckDB instead",
    )
    args = ap.parse_args()
    if args.smoke:
        args.rows, args.rounds = args.rows or 20_000, 1
    rows = args.rows or (3_000_000 if args.quick else 10_000_000)
    if args.engines:
        compare_engines(rows, max(args.rounds, 3))
        return
    root = Path(tempfile.mkdtemp(prefix="gpuyard-bench-transform-"))
    os.environ["GPUYARD_HOME"] = str(root / "home")
    os.environ.pop("GPUYARD_DATABASE_URL", None)
    os.environ.pop("GPUYARD_ARTIFACTS", None)
    from gpuyard.data import IngestOptions, ValidationSpec, ingest

    src = root / "src.parquet"
    make_source(src, rows)
    t0 = time.perf_counter()
    version = ingest(
        src, "bench", IngestOptions(shard_bytes=64 << 20, checks=ValidationSpec(duplicates="keep"))
    )
    print(f"ingest {rows:,} rows: {time.perf_counter() - t0:.2f} s, {len(version.shards)} shards")
    # Every side reads the version's shard files: hard links to the blobs gpuyard reads, in shard order.
    from gpuyard.store import get_artifacts

    shard_dir = root / "shards"
    shard_dir.mkdir()
    for i, shard in enumerate(version.shards):
        blob = get_artifacts()._path(shard.key)
        try:
            os.link(blob, shard_dir / f"shard-{i:05d}.parquet")
        except OSError:
            os.symlink(blob, shard_dir / f"shard-{i:05d}.parquet")
    src.unlink()  # nothing reads the original from here on

    # The statistics every side uses, precomputed: gpuyard reads them from the version's manifest
    # (computed at ingest), the others from this JSON file of the same figures; both reads are timed.
    import json

    from gpuyard.data import load_recipe
    from gpuyard.data.transforms import fit_from_stats

    fitted = fit_from_stats(load_recipe(RECIPE), version)
    assert fitted is not None
    stats = root / "fitted.json"
    stats.write_text(json.dumps(fitted))

    # Each contender runs in a fresh process of its own: its time excludes Python's start-up and
    # imports, and its peak memory is its own (for gpuyard: the driver or the largest pool worker).
    # Rounds run every contender once, the order rotated each round so that a busy moment of the
    # shared machine falls on different contenders; ratios are per round (gpuyard against the
    # baselines of the same round), reported as the median and the spread over the rounds.
    pandas_out = root / "pandas.parquet"
    gpuyard_args = (str(args.workers), version.ref, str(pandas_out))
    inp = str(shard_dir)
    contenders: dict[str, tuple[str, ...]] = {
        "pandas": ("pandas", inp, str(pandas_out), str(stats)),
        "gpuyard": ("gpuyard-thread", *gpuyard_args),
        "polars_array": ("polars-array", inp, str(root / "polars.parquet"), str(stats)),
        "duckdb": ("duckdb", inp, str(root / "duckdb.parquet"), str(stats)),
        "gpuyard_pool": ("gpuyard-pool", *gpuyard_args),
        "polars_binary": ("polars-binary", inp, str(root / "polars.parquet"), str(stats)),
    }
    names = list(contenders)
    # pandas first in the first round: gpuyard's check reads its output.
    rounds: list[dict[str, tuple[float, float, float]]] = []
    for r in range(args.rounds):
        order = names[r % len(names) :] + names[: r % len(names)] if r else names
        rounds.append({name: _spawn("--child", *contenders[name]) for name in order})
    sec = {name: [rd[name][0] for rd in rounds] for name in names}
    peak = {name: max(rd[name][1] for rd in rounds) / 1024 for name in names}
    med = {name: statistics.median(v) for name, v in sec.items()}
    baselines = ("pandas", "polars_array", "polars_binary", "duckdb")
    # Each competitor in its best configuration: Polars by the faster of its two idioms.
    for rd in rounds:
        rd["polars"] = min(rd["polars_array"], rd["polars_binary"])
    best_of = [min(("pandas", "polars", "duckdb"), key=lambda k: rd[k][0]) for rd in rounds]
    vs_pandas = [rd["pandas"][0] / rd["gpuyard"][0] for rd in rounds]
    vs_best = [min(rd[k][0] for k in ("pandas", "polars", "duckdb")) / rd["gpuyard"][0] for rd in rounds]
    # CPU of the timed sections (every thread of the contender's process): what a busy shared
    # machine does not inflate as much as wall time. The pool's workers are other processes, so the
    # pool has no CPU figure here.
    cpu_vs_best = [min(rd[k][2] for k in baselines) / rd["gpuyard"][2] for rd in rounds]
    cpu = {name: statistics.median(rd[name][2] for rd in rounds) for name in names}
    pool_vs_best = [
        min(rd[k][0] for k in ("pandas", "polars", "duckdb")) / rd["gpuyard_pool"][0] for rd in rounds
    ]
    from gpuyard.data import open_dataset

    shards = len(open_dataset("bench-out").shards)
    for name in names:
        all_s = ", ".join(f"{x:.2f}" for x in sec[name])
        print(
            f"{name:>13}: median {med[name]:.2f} s = {rows / med[name]:,.0f} rows/s (rounds: {all_s}), "
            f"CPU {cpu[name]:.2f} s{' (driver only)' if name == 'gpuyard_pool' else ''}, "
            f"peak RSS {peak[name]:.0f} MiB"
        )
    print(f"gpuyard: {args.workers} threads (pool: processes), {shards} output shards")
    print("fastest baseline per round: " + ", ".join(best_of))

    def spread(v: list[float]) -> str:
        return f"{statistics.median(v):.2f}x (rounds {min(v):.2f}-{max(v):.2f})"

    print(f"gpuyard vs pandas {spread(vs_pandas)}; vs the fastest baseline {spread(vs_best)}")
    print(
        f"transform: vs_pandas={statistics.median(vs_pandas):.2f}x vs_best={statistics.median(vs_best):.2f}x "
        f"vs_best_min={min(vs_best):.2f}x vs_best_max={max(vs_best):.2f}x "
        f"pool_vs_best={statistics.median(pool_vs_best):.2f}x "
        f"cpu_vs_best={statistics.median(cpu_vs_best):.2f}x "
        + " ".join(f"{name}_s={med[name]:.2f}" for name in ("gpuyard", "gpuyard_pool", *baselines))
        + " "
        + " ".join(f"{name}_cpu_s={cpu[name]:.2f}" for name in ("gpuyard", *baselines))
        + f" rows={rows} workers={args.workers} rounds={args.rounds} "
        f"gpuyard_peak_rss_mib={peak['gpuyard']:.0f} pandas_peak_rss_mib={peak['pandas']:.0f} "
        f"load_avg={os.getloadavg()[0]:.1f}"
    )
    shutil.rmtree(root, ignore_errors=True)  # 10M rows per run: leave nothing behind


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3:])
    else:
        main()
