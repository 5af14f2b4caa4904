"""Training runtime: the loop, parallelism on a device mesh, checkpoints, exact resume, fault tolerance.

Heavy imports (torch) happen in the submodules; import from them directly, e.g.
``from gpuyard.train.trainer import Trainer`` and ``from gpuyard.train.spec import load_spec``.
"""
