"""Loader for the published collective corpus (``collectives.yaml``): nccl-tests results and sources."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

CORPUS_PATH = Path(__file__).parent / "collectives.yaml"

Op = Literal["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv"]


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class PublishedRow(_Strict):
    """One measured point as the source prints it."""

    op: Op
    size_bytes: int = Field(gt=0, description="nccl-tests' size column (bytes).")
    label: str | None = Field(default=None, description="The size as the source labels it.")
    busbw_GBps: float | None = Field(default=None, ge=0, description="Bus bandwidth, GB/s.")
    time_us: float | None = Field(default=None, gt=0, description="Time per collective, microseconds.")

    @model_validator(mode="after")
    def _has_a_figure(self) -> PublishedRow:
        if self.busbw_GBps is None and self.time_us is None:
            raise ValueError("a row needs busbw_GBps or time_us")
        return self


class PublishedSource(_Strict):
    """One published table (or set of tables from one run), with where it was found."""

    key: str
    where: str = Field(description="Repository/file/section or page/table the figures are copied from.")
    system: str = Field(description="gpuyard cluster preset the hardware matches.")
    description: str
    gpus: int = Field(gt=0)
    gpus_per_node: int = Field(gt=0)
    nccl: str | None = Field(default=None, description="NCCL version, when the source states it.")
    placement: Literal["in-place", "out-of-place"]
    algorithm: Literal["ring", "tree", "nvls", "nvls_tree", "pat"] | None = Field(
        default=None, description="Algorithm forced with NCCL_ALGO, None when NCCL chose."
    )
    notes: str = ""
    tolerance_pct: float = Field(gt=0, description="Largest |busbw error| the tests accept for this source.")
    rows: tuple[PublishedRow, ...]


class CollectiveRow(_Strict):
    """A corpus row with its source's shared fields: what the model is asked to predict."""

    source: str
    where: str
    system: str
    gpus: int
    gpus_per_node: int
    op: Op
    size_bytes: int
    busbw_GBps: float | None
    time_us: float | None
    placement: str
    nccl: str | None
    algorithm: str | None
    tolerance_pct: float

    @property
    def nodes(self) -> int:
        """Nodes the run spans."""
        return max(1, self.gpus // self.gpus_per_node)


class Corpus(_Strict):
    """The whole file."""

    sources: tuple[PublishedSource, ...]

    @property
    def rows(self) -> list[CollectiveRow]:
        """Every row, flattened with its source's fields."""
        return [
            CollectiveRow(
                source=s.key,
                where=s.where,
                system=s.system,
                gpus=s.gpus,
                gpus_per_node=s.gpus_per_node,
                op=r.op,
                size_bytes=r.size_bytes,
                busbw_GBps=r.busbw_GBps,
                time_us=r.time_us,
                placement=s.placement,
                nccl=s.nccl,
                algorithm=s.algorithm,
                tolerance_pct=s.tolerance_pct,
            )
            for s in self.sources
            for r in s.rows
        ]


@lru_cache(maxsize=4)
def load_collectives(path: Path = CORPUS_PATH) -> Corpus:
    """Read and validate the published collective corpus.

    Args:
        path: the YAML file (default: the one shipped with gpuyard).

    Returns:
        The validated corpus; ``corpus.rows`` flattens it.

    Raises:
        pydantic.ValidationError: a source or row is malformed (the message names the field).
    """
    data = yaml.safe_load(path.read_text())
    corpus = Corpus.model_validate(data)
    keys = [s.key for s in corpus.sources]
    if len(keys) != len(set(keys)):
        raise ValueError(f"duplicate source keys in {path}")
    return corpus
