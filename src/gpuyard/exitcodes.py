"""Process exit codes that carry meaning between gpuyard components (training runtime <-> scheduler)."""

SUCCESS = 0
# A user error (bad spec, bad input): the CLI's code for GpuyardError.
USAGE = 2
# The job stopped on request (SIGTERM from the scheduler) after writing a checkpoint, and can resume.
# 75 is EX_TEMPFAIL in sysexits.h: "temporary failure, try again later".
PREEMPTED = 75
# Training stopped because the loss became NaN or infinite; the last good checkpoint is kept.
DIVERGED = 76
# Failed in a way a restart would repeat (the disk is full, the input is corrupt): do not retry it
# unchanged. 74 is EX_IOERR in sysexits.h. `gpuyard train` stops torchrun's restarts on it.
UNRECOVERABLE = 74


def exit_now(code: int) -> None:
    """End this process with ``code`` now, without the interpreter's teardown.

    For the processes that only run work and leave (training ranks, the ``gpuyard train`` launcher,
    task processes): freeing torch and the rest of their imports takes 0.5-0.7 s a process on this
    machine. Call it once their outputs are written and closed: logging is shut down and stdout and
    stderr are flushed here, but ``atexit`` handlers do not run and remaining (daemon) threads stop.
    """
    import logging
    import os
    import sys

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
