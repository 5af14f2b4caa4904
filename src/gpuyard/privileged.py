"""What a process of gpuyard that runs as root (the server, its shim) starts, and how it reads files.

A member chooses a job's environment, its paths and what its folder holds. None of it may steer a
program the server runs with its own privileges, and no file a member can reach is opened by the
server as if it were its own:

- :func:`environment` is the whole environment of every program the server (or its shim) runs as
  itself: a fixed system ``PATH``, a UTF-8 C locale, the server user's ``HOME``, ``TZ`` when the
  server has one, and the variables the caller adds from the server's own configuration (e.g.
  ``SLURM_CONF``), which may not be dynamic-loader or Python variables. Nothing else of any
  environment reaches it.
- :func:`program` resolves a program on that ``PATH`` to an absolute path once, so no ``PATH``
  lookup happens in the child.
- :func:`job_env_refusal` is the rule a job's own ``env`` must pass at submit: no preload or audit
  object for the dynamic loader, no input variable of the Slurm tools, none of the names gpuyard sets
  for the job (its token, its server's URL).
- :func:`read_beneath` opens a file under a directory the server trusts, one component at a time
  with ``O_NOFOLLOW`` (no symbolic link anywhere below that directory), checks it is a regular file
  of the expected owner and reads at most a given number of bytes.
- :func:`read_as` reads a file as a member's Unix user (in a child process that changes to that
  user first), so the server learns only what that user could read anyway, and at most a given size.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from gpuyard.errors import ConfigError, NotFoundError

SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
LOCALE = "C.UTF-8"
# A variable name as a shell and exec accept it (a job's env names are checked against it too).
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Variables that load code into, or redirect, whatever program they reach (glibc's loader, Python).
_LOADER_PREFIXES = ("LD_", "PYTHON")
_LOADER_NAMES = frozenset({"GCONV_PATH", "MALLOC_TRACE", "LOCPATH", "NLSPATH", "HOSTALIASES", "RES_OPTIONS"})
# What the Slurm client tools read as options (sbatch: SBATCH_*, srun: SLURM_*/SRUN_*, ...).
SLURM_INPUT_PREFIXES: tuple[str, ...] = ("SLURM_", "SBATCH_", "SALLOC_", "SRUN_", "SQUEUE_", "SINFO_")
SLURM_INPUT_PREFIXES += ("SCONTROL_", "SCANCEL_", "SACCT_", "SSTAT_")
# Names a job may not set in its spec: the loader's injection points (a job preloads in its own
# command if it must), the Slurm tools' input (gpuyard's placement and accounting decide those), and
# what gpuyard itself gives the job (its token and its server).
JOB_REFUSED_NAMES = frozenset({"LD_PRELOAD", "LD_AUDIT", "GPUYARD_TOKEN", "GPUYARD_SERVER"})
READ_CAP = 1 << 20


def environment(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The whole environment of a program the server runs as itself.

    Args:
        extra: variables of the server's own configuration the program needs (``SLURM_CONF``).

    Raises:
        ConfigError: ``extra`` names a loader or Python variable, or a name that is not one.
    """
    env = {"PATH": SYSTEM_PATH, "LANG": LOCALE, "LC_ALL": LOCALE}
    try:
        env["HOME"] = pwd.getpwuid(os.geteuid()).pw_dir
    except KeyError:
        env["HOME"] = "/"
    tz = os.environ.get("TZ", "")
    if tz and not tz.startswith((":", "/", ".")):  # a zone name, never a file of someone's
        env["TZ"] = tz
    for key, value in (extra or {}).items():
        if not ENV_NAME.fullmatch(key) or is_loader_var(key):
            raise ConfigError(f"{key}: not a variable gpuyard passes to a program it runs as itself")
        env[key] = value
    return env


def is_loader_var(name: str) -> bool:
    """True for a variable that makes glibc's loader or Python load code from where it says."""
    return name.startswith(_LOADER_PREFIXES) or name in _LOADER_NAMES


def program(name: str) -> str:
    """The absolute path of ``name`` on :data:`SYSTEM_PATH` (an absolute ``name`` is checked as is).

    Raises:
        NotFoundError: no such program there (one line naming the PATH searched).
    """
    found = name if os.path.isabs(name) and os.access(name, os.X_OK) else None
    if not os.path.isabs(name):
        found = shutil.which(name, path=SYSTEM_PATH)
    if found is None:
        raise NotFoundError(f"{name}: no such program on {SYSTEM_PATH}")
    return found


def run(
    argv: list[str], extra_env: Mapping[str, str] | None = None, **kwargs: object
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run`` of ``argv`` with its program resolved and :func:`environment` (text mode)."""
    return subprocess.run(  # type: ignore[call-overload, no-any-return]
        [program(argv[0]), *argv[1:]], env=environment(extra_env), text=True, **kwargs
    )


def job_env_refusal(name: str) -> str | None:
    """Why a job's spec may not set variable ``name`` (one phrase), or None when it may."""
    if not ENV_NAME.fullmatch(name):
        return "not a variable name (letters, digits and _, not starting with a digit)"
    if name in JOB_REFUSED_NAMES and name.startswith("GPUYARD_"):
        return "gpuyard sets it for the job"
    if name in JOB_REFUSED_NAMES:
        return "a dynamic-loader injection variable; preload in the job's own command if it needs one"
    if name.startswith(SLURM_INPUT_PREFIXES):
        return "an input variable of the Slurm tools; gpuyard's placement sets what they get"
    return None


# --- Reading what a member can write -----------------------------------------------------------------

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC


def open_beneath(base: str | Path, rel: str | Path, owners: set[int] | None = None) -> int:
    """A read-only descriptor of the regular file ``base/rel``, no link followed below ``base``.

    ``base`` is a directory of the server's own; every component of ``rel`` is opened relative to
    the one before with ``O_NOFOLLOW`` (a link, a FIFO or a device is refused, never opened as such).

    Raises:
        FileNotFoundError: no such file.
        PermissionError: a component is a link, the file is not a regular file, or (``owners``) not
            owned by one of those users (the message names which, never what the file holds).
    """
    parts = [p for p in Path(rel).parts if p not in ("", ".")]
    if not parts or ".." in parts or Path(rel).is_absolute():
        raise PermissionError(f"{rel}: not a path below {base}")
    fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in parts[:-1]:
            try:
                nxt = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                raise _refusal(exc, base, rel) from None
            os.close(fd)
            fd = nxt
        try:
            leaf = os.open(parts[-1], _FILE_FLAGS, dir_fd=fd)
        except OSError as exc:
            raise _refusal(exc, base, rel) from None
    finally:
        os.close(fd)
    st = os.fstat(leaf)
    why = ""
    if not stat.S_ISREG(st.st_mode):
        why = "not a regular file"
    elif owners is not None and st.st_uid not in owners:
        why = f"owned by uid {st.st_uid}, not by the job's user"
    if why:
        os.close(leaf)
        raise PermissionError(f"{Path(base) / rel}: {why}; not read")
    return leaf


def _refusal(exc: OSError, base: str | Path, rel: str | Path) -> OSError:
    import errno

    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
        return PermissionError(f"{Path(base) / rel}: a symbolic link on the way; not followed")
    if isinstance(exc, FileNotFoundError):
        return FileNotFoundError(f"{Path(base) / rel}: no such file")
    return exc


def read_beneath(
    base: str | Path, rel: str | Path, owners: set[int] | None, offset: int = 0, limit: int = READ_CAP
) -> bytes:
    """Up to ``limit`` bytes from ``offset`` of ``base/rel`` opened by :func:`open_beneath`."""
    fd = open_beneath(base, rel, owners)
    with os.fdopen(fd, "rb") as fh:
        if offset >= os.fstat(fd).st_size:  # past the end there is nothing (seeking far past is EINVAL)
            return b""
        fh.seek(offset)
        return fh.read(limit)


# The child of read_as: started as the server (the interpreter may lie where only the server can
# read), it becomes the member's user before it opens anything, refuses what is not a regular file or
# is larger than the cap (before reading a byte of it) and writes what it read to stdout. It runs with
# -I -S and the privileged environment: nothing of the member's steers it but the path it opens.
_READER = r"""
import os, stat, sys
path, cap, uid, gid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
os.setgroups([])
os.setgid(gid)
os.setuid(uid)
try:
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY)
except FileNotFoundError:
    sys.exit(3)
except OSError as exc:
    print(f"it cannot: {exc.strerror}", file=sys.stderr); sys.exit(4)
st = os.fstat(fd)
if not stat.S_ISREG(st.st_mode):
    print("not a regular file", file=sys.stderr); sys.exit(4)
if st.st_size > cap:
    print(f"{st.st_size} bytes, more than {cap}", file=sys.stderr); sys.exit(4)
data = os.read(fd, cap + 1)
if len(data) > cap:
    print(f"more than {cap} bytes", file=sys.stderr); sys.exit(4)
sys.stdout.buffer.write(data)
"""


def read_as(uid: int | None, gid: int | None, path: str | Path, cap: int = READ_CAP) -> bytes | None:
    """What user ``uid`` reads in the regular file ``path`` (at most ``cap`` bytes); None when there
    is no such file. ``uid`` None (the server's own user: not root or not isolated): read here, under
    the same checks.

    Raises:
        ConfigError: the user cannot read it, it is not a regular file, or it is larger than ``cap``
            (one line naming the path, never its content).
    """
    if uid is None or uid == os.geteuid():
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read it ({exc.strerror})") from None
        with contextlib.closing(os.fdopen(fd, "rb")) as fh:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ConfigError(f"{path}: not a regular file")
            if st.st_size > cap:
                raise ConfigError(f"{path}: {st.st_size} bytes, more than the {cap} read here")
            data = fh.read(cap + 1)
        if len(data) > cap:
            raise ConfigError(f"{path}: more than the {cap} bytes read here")
        return data
    try:
        proc = subprocess.run(
            [sys.executable, "-I", "-S", "-c", _READER, str(path), str(cap), str(uid), str(gid)],
            cwd="/",
            env=environment(),
            capture_output=True,
            timeout=30,
            check=False,
        )
    except subprocess.TimeoutExpired:
        raise ConfigError(f"{path}: not read within 30 s") from None
    if proc.returncode == 3:
        return None
    if proc.returncode != 0:
        why = proc.stderr.decode(errors="replace").strip().splitlines() or [f"exit {proc.returncode}"]
        name = _user_name(uid)
        raise ConfigError(f"{path}: not read as {name} ({why[-1][:200]})")
    return proc.stdout


def _user_name(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name}"
    except KeyError:
        return f"uid {uid}"
