"""Process exit codes that carry meaning between gpuyard components (training runtime <-> scheduler)."""

SUCCESS = 0
# A user error (bad spec, bad input): the CLI's code for GpuyardError.
USAGE = 2
# The job stopped on request (SIGTERM from the scheduler) after writing a checkpoint, and can resume.
# 75 is EX_TEMPFAIL in sysexits.h: "temporary failure, try again later".
PREEMPTED = 75
# Training stopped because the loss became NaN or infinite; the last good checkpoint is kept.
DIVERGED = 76
