"""Names the training launcher and its workers share: files and environment variables.

Kept in a module that imports nothing, so that ``gpuyard train`` (the launcher) reads them without
importing the trainer, the checkpointing or torch.distributed.checkpoint, which only its workers need.
"""

from __future__ import annotations

# Where a worker says how the run ended (in the run folder); the launcher maps it to an exit code.
STATUS_FILE = "status.json"
# The folder of a node's in-memory snapshots (/dev/shm), set by the launcher for its workers.
SNAPSHOT_DIR_ENV = "GPUYARD_SNAPSHOT_DIR"
# Set by `gpuyard train`: the launcher reads status.json, so workers exit 0 on preemption and
# divergence; otherwise torchrun would count their exit as a failure and restart them.
LAUNCHED_ENV = "GPUYARD_TRAIN_LAUNCHED"
# Set by `gpuyard train`: a folder only the launcher's user can enter, where rank 0 writes
# status.json when the run folder cannot take it (a full disk).
STATUS_FALLBACK_ENV = "GPUYARD_TRAIN_STATUS_DIR"
