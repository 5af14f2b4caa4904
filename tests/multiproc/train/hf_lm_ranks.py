"""One rank of test_hf_lm.py's two-rank launch (run by torchrun): trains each spec named on the command
line in turn in the same process group (FSDP2 over 2 ranks, then tensor parallel over 2 ranks), and
writes what the test checks about the sharding beside each run (``shards.json``, rank 0)."""

from __future__ import annotations

import json
import sys
from typing import Any

from torch.distributed.tensor import DTensor

from gpuyard.exitcodes import exit_now
from gpuyard.train.spec import load_spec
from gpuyard.train.trainer import Trainer


def shard_facts(trainer: Trainer) -> dict[str, Any]:
    """Each parameter's kind and local and full shapes on this rank."""
    facts: dict[str, Any] = {"layout": [trainer.ctx.layout.pp, trainer.ctx.layout.dp, trainer.ctx.layout.tp]}
    for name, p in trainer.model.named_parameters():
        local = p.to_local() if isinstance(p, DTensor) else p
        facts[name] = {"dtensor": isinstance(p, DTensor), "local": list(local.shape), "full": list(p.shape)}
    return facts


def main() -> None:
    trainer: Trainer | None = None
    for path in sys.argv[1:]:
        trainer = Trainer(load_spec(path))
        trainer.fit()
        if trainer.ctx.rank == 0:
            (trainer.run_dir / "shards.json").write_text(json.dumps(shard_facts(trainer)))
    if trainer is not None:
        trainer.close()


if __name__ == "__main__":
    main()
    # As gpuyard's own training ranks do: no interpreter teardown. Freeing the first run's FSDP state
    # after the process group is gone aborted a rank once ("terminate called without an active
    # exception", SIGABRT) after both runs had finished and written their outputs.
    exit_now(0)
