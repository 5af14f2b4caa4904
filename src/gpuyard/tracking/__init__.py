"""Run tracking: one place for runs, their parameters, metric series, status and lineage.

- :mod:`gpuyard.tracking.files`: the tracking interface and ``metrics.jsonl`` (every training run).
- :mod:`gpuyard.tracking.store`: a run in the state store (one writer thread per run, which also
  samples system metrics); used by model management, the pipelines and the trainer.
- :mod:`gpuyard.tracking.training`: the trainer's tracker under ``tracking: db``: metrics.jsonl plus
  the state-store run, kept across restarts, its database work on the run's one writer thread.

Statuses are :class:`gpuyard.states.RunStatus`. Nothing is imported here, so that importing one of
these modules costs only what it needs.
"""
