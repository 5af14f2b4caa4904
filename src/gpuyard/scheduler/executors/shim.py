"""Runs one job's command and records its exit code in a file, so a restarted server can learn it.

Started as ``python -I -S shim.py PID_FILE EXIT_FILE [--job FILE] -- ARGV...`` in a new session (the
job's process group). It survives SIGTERM sent to the group (a Python handler, which exec resets, so the
command still receives SIGTERM with the default action) and writes the command's exit code atomically;
a SIGKILL of the group leaves no exit file, which the executor reads as "killed". Standard library only:
it must start fast and never import gpuyard.

With ``--job FILE`` (`gpuyard server`'s isolation) the file holds the command's whole environment, its
working directory and the Unix user it runs as. The shim stays the server's user (the pid and exit
files are in the server's private home); the command changes user before it enters its working
directory, so a directory its user cannot reach is refused. The shim itself runs with ``-I`` and the
server's environment: nothing of the job's (PYTHONPATH, LD_PRELOAD) touches it.
"""

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable  # already loaded at start-up; typing is not: the shim starts fast


def main() -> int:
    """Run the command after ``--``; return its exit code (128 + signal when it was killed)."""
    pid_file, exit_file = sys.argv[1], sys.argv[2]
    options = sys.argv[3 : sys.argv.index("--")]
    argv = sys.argv[sys.argv.index("--") + 1 :]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)  # the group's signal is for the command, not for us
    with open(pid_file + ".tmp", "w") as fh:
        fh.write(str(os.getpid()))
    os.replace(pid_file + ".tmp", pid_file)
    kwargs = {}
    if options[:1] == ["--job"]:
        with open(options[1]) as fh:
            job = json.load(fh)
        kwargs = {"env": job["env"], "preexec_fn": _enter(job["cwd"])}  # runs after the user change
        if job.get("uid") is not None:
            kwargs.update(user=job["uid"], group=job["gid"], extra_groups=[])
    try:
        proc = subprocess.Popen(argv, **kwargs)
    except (OSError, subprocess.SubprocessError) as exc:
        hint = ""
        if isinstance(exc, PermissionError) and "user" in kwargs:
            hint = (
                f" (the job runs as uid {kwargs['user']}, which cannot read the program or its "
                "interpreter, e.g. a virtual environment under a private home: see the server's startup line)"
            )
        print(f"gpuyard: cannot start {argv[0]!r}: {exc}{hint}", file=sys.stderr, flush=True)
        code = 127
    else:
        code = proc.wait()
    with open(exit_file + ".tmp", "w") as fh:
        fh.write(str(code))
    os.replace(exit_file + ".tmp", exit_file)
    return 128 - code if code < 0 else code


def _enter(cwd: str) -> Callable[[], None]:
    """In the child, as the job's user: enter ``cwd``, or say why not and exit 126."""

    def enter() -> None:
        try:
            os.chdir(cwd)
        except OSError as exc:
            os.write(2, f"gpuyard: cannot enter the working directory {cwd}: {exc.strerror}\n".encode())
            os._exit(126)

    return enter


if __name__ == "__main__":
    sys.exit(main())
