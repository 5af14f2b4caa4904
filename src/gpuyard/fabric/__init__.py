"""GPU backend fabric: cluster description, collective cost model, measured collectives, step model, planner.

Submodules are imported on use: ``cluster`` (presets and files), ``collectives`` (cost model),
``bench`` (measured collectives on torch.distributed), ``models`` (transformer presets),
``step`` (training-step model) and ``planner`` (parallelism search).
"""
