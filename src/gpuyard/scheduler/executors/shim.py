"""Runs one job's command and records its exit code in a file, so a restarted server can learn it.

Started as ``python -S shim.py PID_FILE EXIT_FILE -- ARGV...`` in a new session (the job's process
group). It survives SIGTERM sent to the group (a Python handler, which exec resets, so the command
still receives SIGTERM with the default action) and writes the command's exit code atomically; a
SIGKILL of the group leaves no exit file, which the executor reads as "killed". Standard library only:
it must start fast and never import gpuyard.
"""

import os
import signal
import subprocess
import sys


def main() -> int:
    """Run the command after ``--``; return its exit code (128 + signal when it was killed)."""
    pid_file, exit_file = sys.argv[1], sys.argv[2]
    argv = sys.argv[sys.argv.index("--") + 1 :]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)  # the group's signal is for the command, not for us
    with open(pid_file + ".tmp", "w") as fh:
        fh.write(str(os.getpid()))
    os.replace(pid_file + ".tmp", pid_file)
    try:
        proc = subprocess.Popen(argv)
    except OSError as exc:
        print(f"gpuyard: cannot start {argv[0]!r}: {exc}", file=sys.stderr, flush=True)
        code = 127
    else:
        code = proc.wait()
    with open(exit_file + ".tmp", "w") as fh:
        fh.write(str(code))
    os.replace(exit_file + ".tmp", exit_file)
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())
