"""The same recipe gives the same version on the process pool and on Ray tasks (and in-process)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from gpuyard.data import IngestOptions, ingest, load_recipe, transform
from gpuyard.errors import IntegrityError

pytestmark = pytest.mark.integration

RECIPE = """
derive: [{name: ink, expr: "log1p(pixels_20 + pixels_43)"}]
image: [{column: image, resize: [6, 6], output: small}]
split: {method: stratified, column: label, seed: 3, kfold: 3}
normalize: [{columns: [ink, pixels_20], method: zscore}, {columns: [pixels_43], method: minmax}]
encode: [{column: label, method: onehot}]
"""


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    """A local Ray instance with 2 CPUs on 127.0.0.1, shared by this module's tests."""
    ray = pytest.importorskip("ray")
    import ray._private.ray_constants as ray_constants

    old = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    # Ray turns a loopback address into the host's own address unless clusters are "disabled" (as the
    # scheduler's Ray fixture does): seen here, the driver then waited on 192.0.2.2 until the run was
    # killed. Keep every connection on 127.0.0.1.
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    ray.init(num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()
        ray_constants.ENABLE_RAY_CLUSTER = saved
        if old is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = old


def test_pool_and_ray_give_the_same_version(ray_cluster: None, gpuyard_home: Path, digits_npz: Path) -> None:
    src = ingest(digits_npz, "digits", IngestOptions(label_column="label", shard_bytes=120_000))
    assert len(src.shards) >= 4
    recipe = load_recipe(RECIPE)
    pool = transform(src.ref, recipe, engine="pool", workers=2, output="by-pool")
    ray = transform(src.ref, recipe, engine="ray", output="by-ray")
    serial = transform(src.ref, recipe, engine="serial", output="by-serial")
    threads = transform(src.ref, recipe, engine="thread", workers=2, output="by-threads")
    # Content address: identical shards and stats.
    assert pool.version == ray.version == serial.version == threads.version
    assert [s.sha256 for s in pool.shards] == [s.sha256 for s in ray.shards]
    assert pool.fitted == ray.fitted and pool.stats == ray.stats
    a, b = pool.to_numpy(["ink", "small", "fold"]), ray.to_numpy(["ink", "small", "fold"])
    for key in a:
        np.testing.assert_array_equal(a[key], b[key])


def test_corrupt_shard_is_named_from_a_ray_task(
    ray_cluster: None, gpuyard_home: Path, digits_npz: Path
) -> None:
    src = ingest(digits_npz, "digits", IngestOptions(shard_bytes=120_000))
    victim = Path(src.shard_paths()[1])
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    with pytest.raises(IntegrityError, match=victim.name):
        transform(src.ref, load_recipe("normalize: [{columns: [pixels_20]}]"), engine="ray")
    with pytest.raises(IntegrityError, match=victim.name):
        transform(src.ref, load_recipe("normalize: [{columns: [pixels_20]}]"), engine="pool", workers=2)
