"""Stage kinds: each a function ``fn(inputs: dict, ctx: dict) -> outputs: dict`` over JSON values.

Each kind reads its inputs through its pydantic model in :mod:`gpuyard.pipelines.inputs` (a bad
input is one line naming the stage and the input). ``ctx`` carries ``workdir`` (a folder of the
stage's own), ``base`` (the folder of the pipeline file, for relative paths), ``pipeline`` and
``stage``. Outputs are what later stages reference; an output named ``report`` holds lines for
people (the CLI prints them) and is not meant to be referenced.
"""

from __future__ import annotations

import json
from typing import Any

from gpuyard.errors import ConfigError

KINDS: dict[str, str] = {
    "ingest": "gpuyard.pipelines.stages.data:ingest_stage",
    "transform": "gpuyard.pipelines.stages.data:transform_stage",
    "tune": "gpuyard.pipelines.stages.models:tune_stage",
    "fit": "gpuyard.pipelines.stages.models:fit_stage",
    "train": "gpuyard.pipelines.stages.train:train_stage",
    "evaluate": "gpuyard.pipelines.stages.models:evaluate_stage",
    "register": "gpuyard.pipelines.stages.models:register_stage",
    "serve": "gpuyard.pipelines.stages.serve:serve_stage",
    "plan": "gpuyard.pipelines.stages.fabric:plan_stage",
    "text-ingest": "gpuyard.pipelines.stages.llm:text_ingest_stage",
    "tokenize": "gpuyard.pipelines.stages.llm:tokenize_stage",
    "llm-train": "gpuyard.pipelines.stages.llm:llm_train_stage",
    "llm-register": "gpuyard.pipelines.stages.llm:llm_register_stage",
    "llm-eval": "gpuyard.pipelines.stages.llm:llm_eval_stage",
    "llm-promote": "gpuyard.pipelines.stages.llm:llm_promote_stage",
    "llm-serve": "gpuyard.pipelines.stages.llm:llm_serve_stage",
}


def check_kind(uses: str, stage: str) -> str:
    """The ``module:function`` a stage runs: a known kind, or a reference written as such.

    Raises:
        ValueError: an unknown kind (pydantic turns it into a field error).
    """
    if uses in KINDS:
        return KINDS[uses]
    if ":" in uses and all(uses.split(":", 1)):
        return uses
    raise ValueError(
        f"stage {stage!r}: uses {uses!r} is neither a stage kind ({', '.join(KINDS)}) nor module:function"
    )


def run_stage(uses: str, inputs: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """Run one stage in this process (the body of a stage's job) and return its JSON outputs.

    Raises:
        ConfigError: the stage returned something other than a JSON mapping.
    """
    from gpuyard.refs import import_ref

    fn = import_ref(check_kind(uses, ctx.get("stage", "?")))
    out = fn(inputs, ctx)
    if not isinstance(out, dict):
        raise ConfigError(f"stage {ctx.get('stage')!r} ({uses}) returned {type(out).__name__}, not a mapping")
    json.dumps(out)  # a TypeError here names the first value that is not JSON
    return out
