# mypy: disable-error-code="type-arg"
"""Runs one job's command and records its exit code in a file, so a restarted server can learn it.

Started as ``python -I -S shim.py PID_FILE EXIT_FILE [--job FILE] -- ARGV...`` in a new session (the
job's process group). It survives SIGTERM sent to the group (a Python handler, which exec resets, so the
command still receives SIGTERM with the default action) and writes the command's exit code atomically;
a SIGKILL of the group leaves no exit file, which the executor reads as "killed". Standard library only:
it must start fast and never import gpuyard.

With ``--job FILE`` (`gpuyard server`) the file holds what the command gets:

- ``env``, ``cwd``, ``uid``/``gid``: its whole environment, working directory and Unix user. The shim
  stays the server's user (the pid and exit files are in the server's private home); the command
  changes user before it enters its working directory, so a directory its user cannot reach is refused.
- ``cgroup``: the attempt's cgroup (made by the server). The shim enters it just before starting the
  command (which is born inside it), goes back to the server's cgroup at once, and when the command
  ends kills whatever of the job is left in it and reads its OOM count.
- ``rlimits``: setrlimit values (NOFILE, DATA, NPROC) set in the command before it runs.
- ``log_cap``: the command's output goes through a pipe: the first ``log_cap`` bytes reach the log, then
  one line saying where it was cut; the rest is read and discarded (the job is not blocked).
- ``log_budget`` and ``disk_reserve`` (`gpuyard server`'s disk shares): the log is also cut once it
  would pass the size the server allows it (``log_budget`` names a JSON file ``{"size": BYTES, "why":
  TEXT}`` the server rewrites as the team's quota is used, read again whenever it changes), or would
  leave less than ``disk_reserve`` bytes free on its disk (checked before every write). The cut is
  said in the log and, at once, in ``EXIT_FILE.cut`` (JSON: why), which the server turns into a job
  event while the job runs.
- ``namespace``: a private mount namespace for the job (root only): its own ``/dev/shm`` (tmpfs), a
  ``/proc`` that hides other users' processes (hidepid) and, with ``tmp``, that folder (the attempt's
  own, 0700) as its ``/tmp``, the folders in ``keep`` bound back at their paths inside it.

What the shim learnt (start error, log cut, OOM kills) goes to ``EXIT_FILE.why`` (JSON) before the exit
file. The shim itself runs with ``-I`` and the server's environment: nothing of the job's touches it.
``shim.py --probe-namespace`` tries the private mounts and exits 0, or prints why not and exits 1.
"""

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable  # already loaded at start-up; typing is not: the shim starts fast

CLONE_NEWNS = 0x00020000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REC, MS_PRIVATE = 2, 4, 8, 16384, 1 << 18
MS_REMOUNT, MS_BIND = 32, 4096


def main() -> int:
    """Run the command after ``--``; return its exit code (128 + signal when it was killed)."""
    if sys.argv[1:2] == ["--probe-namespace"]:
        return _probe()
    pid_file, exit_file = sys.argv[1], sys.argv[2]
    options = sys.argv[3 : sys.argv.index("--")]
    argv = sys.argv[sys.argv.index("--") + 1 :]
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)  # the group's signal is for the command, not for us
    with open(pid_file + ".tmp", "w") as fh:
        fh.write(str(os.getpid()))
    os.replace(pid_file + ".tmp", pid_file)
    job: dict = {}
    if options[:1] == ["--job"]:
        with open(options[1]) as fh:
            job = json.load(fh)
    # The exit files are written through a handle on their folder taken now: a private /tmp mounted
    # for the job (below) may hide the path of that folder.
    folder = os.open(os.path.dirname(os.path.abspath(exit_file)), os.O_RDONLY | os.O_DIRECTORY)
    name = os.path.basename(exit_file)
    why: dict = {}
    code = _run(argv, job, why, exit_file)
    if why:
        _write_at(folder, name + ".why", json.dumps(why))
    _write_at(folder, name, str(code))
    return 128 - code if code < 0 else code


def _write_at(folder: int, name: str, text: str) -> None:
    """Write ``name`` in the folder of descriptor ``folder`` atomically (a temp file, then a rename)."""
    fd = os.open(name + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o644, dir_fd=folder)
    with open(fd, "w") as fh:
        fh.write(text)
    os.replace(name + ".tmp", name, src_dir_fd=folder, dst_dir_fd=folder)


def _run(argv: list, job: dict, why: dict, exit_file: str = "") -> int:
    err_r, err_w = os.pipe()  # the command's user/folder/limit failure, said before it exits 126
    kwargs: dict = {}
    if job:
        if job.get("env") is not None:
            kwargs["env"] = job["env"]
        kwargs["preexec_fn"] = _enter(
            job.get("cwd"), job.get("rlimits") or {}, err_w
        )  # after the user change
        if job.get("uid") is not None:
            kwargs.update(user=job["uid"], group=job["gid"], extra_groups=[])
    cap = job.get("log_cap")
    piped = bool(cap or job.get("log_budget") or job.get("disk_reserve"))
    if piped:
        kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if job.get("namespace"):
        try:
            private_mounts(job["namespace"])
        except OSError as exc:
            if job["namespace"].get("tmp"):  # its TMPDIR and caches say /tmp: never the shared one
                return _cannot_start(why, f"its private /tmp could not be set up: {exc}")
            _say(f"private /dev/shm and /proc not set up: {exc}")
    cgroup = job.get("cgroup") or {}
    try:
        for procs in cgroup.get("procs", []):
            _write(procs, str(os.getpid()))  # the command is born in the job's cgroup
    except OSError as exc:
        _leave(cgroup)
        return _cannot_start(why, f"cannot enter the job's cgroup {procs}: {exc.strerror}")
    try:
        proc = subprocess.Popen(argv, **kwargs)
    except (OSError, subprocess.SubprocessError) as exc:
        os.close(err_r)
        hint = ""
        if isinstance(exc, PermissionError) and "user" in kwargs:
            hint = (
                f" (the job runs as uid {kwargs['user']}, which cannot read the program or its "
                "interpreter, e.g. a virtual environment under a private home: see the server's startup line)"
            )
        return _cannot_start(why, f"cannot start {argv[0]!r}: {exc}{hint}")
    finally:
        _leave(cgroup)
        os.close(err_w)
    said = _read_all(err_r)
    copier = None
    if piped:
        assert proc.stdout is not None
        bounds = _Bounds(int(cap or 0), job.get("log_budget"), int(job.get("disk_reserve") or 0))
        copier = threading.Thread(
            target=_copy, args=(proc.stdout.fileno(), bounds, why, exit_file), daemon=True
        )
        copier.start()
    code = proc.wait()
    if said:
        why["start_error"] = said.decode(errors="replace").strip()[:500]
    if cgroup:
        why["oom_kills"] = _oom_kills(cgroup)
        _kill_all(cgroup)  # what the command left behind ends with it (and lets go of the log pipe)
    if copier is not None:
        copier.join(timeout=2.0)
    return code


def _cannot_start(why: dict, message: str) -> int:
    _say(message)
    why["start_error"] = message[:500]
    return 127


def _say(message: str) -> None:
    print(f"gpuyard: {message}", file=sys.stderr, flush=True)


def _write(path: str, text: str) -> None:
    with open(path, "w") as fh:
        fh.write(text)


def _leave(cgroup: dict) -> None:
    for procs in cgroup.get("leave", []):
        try:
            _write(procs, str(os.getpid()))
        except OSError:
            continue


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


class _Bounds:
    """What the log may still take: the attempt's cap, the server's allowance, the disk's reserve."""

    def __init__(self, cap: int, budget_file: str | None, reserve: int) -> None:
        self.cap, self.budget_file, self.reserve = cap, budget_file, reserve
        self.budget: dict | None = None
        self.seen: tuple | None = None
        try:
            self.size = os.fstat(1).st_size  # the log is opened for appending: earlier attempts' output
        except OSError:
            self.size = 0

    def room(self, written: int, want: int) -> tuple[int, str]:
        """Bytes of ``want`` that may be written now, and why not more ("" when all may)."""
        room, why = want, ""
        if self.cap and self.cap - written < room:
            room, why = self.cap - written, ""  # the --job-log-mb cut keeps its own words
        if self.budget_file:
            try:  # one stat per write: the server's new allowance is seen at once
                info = os.stat(self.budget_file)
                seen = (info.st_ino, info.st_mtime_ns, info.st_size)
            except OSError:
                seen = None
            if seen is not None and seen != self.seen:
                self.seen = seen
                with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
                    with open(self.budget_file) as fh:
                        doc = json.load(fh)
                    self.budget = {"size": int(doc["size"]), "why": str(doc.get("why", ""))[:300]}
            if self.budget is not None and self.budget["size"] - self.size < room:
                room, why = self.budget["size"] - self.size, self.budget["why"] or "the server's allowance"
        if self.reserve:
            try:
                st = os.fstatvfs(1)
            except OSError:
                st = None
            if st is not None:
                free = st.f_bavail * st.f_frsize
                if free - self.reserve < room:
                    room = free - self.reserve
                    why = (
                        f"the log's disk has {_size(max(free, 0))} free and the server keeps "
                        f"{_size(self.reserve)} of it (--disk-reserve-mb)"
                    )
        return max(0, room), why


def _copy(src: int, bounds: _Bounds, why: dict, exit_file: str = "") -> None:
    """Copy the command's output to the log (our stdout) while ``bounds`` allow, then discard it."""
    written = dropped = 0
    cut: str | None = None  # why the log was cut ("" for the attempt's cap)
    while True:
        try:
            chunk = os.read(src, 1 << 16)
        except OSError:
            break
        if not chunk:
            break
        if cut is not None:
            dropped += len(chunk)
            continue
        room, reason = bounds.room(written, len(chunk))
        part = chunk[:room]
        done = _write_out(part) if part else 0
        written += done
        bounds.size += done
        dropped += len(chunk) - done
        if done < len(chunk):
            cut = reason if done == len(part) else "no space left on the log's disk"
            if cut:
                note = f"\n[gpuyard: log cut here after {_size(written)} of this attempt: {cut}; "
            else:
                note = f"\n[gpuyard: log cut here after {_size(bounds.cap)} of this attempt (--job-log-mb); "
            _write_out((note + "the rest is discarded]\n").encode())
            if cut and exit_file:
                _mark_cut(exit_file + ".cut", {"kept": written, "why": cut})
    if dropped:
        why["log_cut"] = {"kept": written, "dropped": dropped}
        shown = _size(bounds.cap) if not cut else _size(written)
        if cut:
            why["log_cut"]["why"] = cut
        _write_out(f"[gpuyard: log cut at {shown}: {dropped} more bytes of output discarded]\n".encode())


def _mark_cut(path: str, doc: dict) -> None:
    try:
        with open(path + ".tmp", "w") as fh:
            json.dump(doc, fh)
        os.replace(path + ".tmp", path)
    except OSError:  # the reserve leaves room for this; if not, the attempt's end says it
        with contextlib.suppress(OSError):
            os.unlink(path + ".tmp")


def _write_out(data: bytes) -> int:
    done = 0
    while done < len(data):
        try:
            done += os.write(1, data[done:])
        except OSError:  # the disk is full: what is not written is lost, the job goes on
            break
    return done


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n} bytes"


def _oom_kills(cgroup: dict) -> int:
    try:
        with open(cgroup.get("memory") or "/nonexistent") as fh:
            for line in fh:
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        with open(cgroup["failcnt"]) as fh:
            return 1 if int(fh.read()) > 0 else 0
    except (OSError, ValueError, KeyError):
        return 0


def _kill_all(cgroup: dict) -> None:
    if cgroup.get("kill") and os.path.exists(cgroup["kill"]):
        with contextlib.suppress(OSError):
            _write(cgroup["kill"], "1")
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        pids: set[int] = set()
        for procs in cgroup.get("procs", []):
            try:
                with open(procs) as fh:
                    pids.update(int(p) for p in fh.read().split())
            except (OSError, ValueError):
                continue
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                continue
        time.sleep(0.02)


def _enter(cwd: str | None, limits: dict, err: int) -> Callable[[], None]:
    """In the child, as the job's user: set the rlimits, enter ``cwd``, or say why not and exit 126."""

    def fail(message: str) -> None:
        os.write(2, f"gpuyard: {message}\n".encode())
        os.write(err, message.encode())
        os._exit(126)

    if limits:
        import resource  # here, as the server's user: the job's user may not read the interpreter's modules

    def enter() -> None:
        if limits:
            for name, value in limits.items():
                which = getattr(resource, f"RLIMIT_{name}")
                try:
                    _, hard = resource.getrlimit(which)
                    value = value if hard == resource.RLIM_INFINITY else min(value, hard)
                    resource.setrlimit(which, (value, value))
                except Exception as exc:  # never an opaque "exception in preexec_fn"
                    fail(f"cannot set RLIMIT_{name} to {value}: {exc}")
        if cwd is not None:
            try:
                os.chdir(cwd)
            except OSError as exc:
                fail(f"cannot enter the working directory {cwd}: {exc.strerror}")

    return enter


def private_mounts(namespace: dict) -> None:
    """This process (and what it starts) in a mount namespace of its own, with a private tmpfs on
    /dev/shm and a /proc of its own that hides other users' processes (hidepid=invisible, else 2)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def call(what: str, *args: object) -> None:
        if getattr(libc, what)(*args) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}{args[:2]}: {os.strerror(err)}")

    call("unshare", CLONE_NEWNS)
    call("mount", b"none", b"/", None, MS_REC | MS_PRIVATE, None)  # nothing leaks back to the host
    if namespace.get("shm") and os.path.isdir("/dev/shm"):
        call("mount", b"tmpfs", b"/dev/shm", b"tmpfs", MS_NOSUID | MS_NODEV, b"mode=1777")
    if namespace.get("hidepid"):
        flags = MS_NOSUID | MS_NODEV | MS_NOEXEC
        try:
            call("mount", b"proc", b"/proc", b"proc", flags, b"hidepid=invisible")
        except OSError:
            call("mount", b"proc", b"/proc", b"proc", flags, b"hidepid=2")
    if namespace.get("tmp"):
        _private_tmp(call, namespace["tmp"], namespace.get("keep") or [])


def _private_tmp(call: Callable[..., None], folder: str, keep: list) -> None:
    """The job's own temp folder becomes its /tmp; each ``keep`` folder under the machine's /tmp (the
    job's own folder, which the server made) is bound back at the same path inside it.

    The mount points are made component by component relative to descriptors, never following a
    link (another job of the same user could have put one there), and mounts name their source
    and target by descriptor (/proc/self/fd), so no path is resolved twice.
    """
    directory = os.O_RDONLY | os.O_DIRECTORY
    old = os.open("/tmp", directory)  # the machine's /tmp, still reachable through this handle
    sources = []
    for path in keep:
        rel = os.path.relpath(path, "/tmp")
        sources.append((rel, os.open(rel, directory, dir_fd=old)))
    call("mount", folder.encode(), b"/tmp", None, MS_BIND, None)
    call("mount", None, b"/tmp", None, MS_BIND | MS_REMOUNT | MS_NOSUID | MS_NODEV, None)
    for rel, src in sources:
        at = os.open("/tmp", directory)
        for part in rel.split("/"):
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, 0o711, dir_fd=at)
            nxt = os.open(part, directory | os.O_NOFOLLOW, dir_fd=at)
            os.close(at)
            at = nxt
        call("mount", f"/proc/self/fd/{src}".encode(), f"/proc/self/fd/{at}".encode(), None, MS_BIND, None)
        os.close(at)
        os.close(src)
    os.close(old)


def _probe() -> int:
    try:
        private_mounts({"shm": True, "hidepid": True})
    except OSError as exc:
        print(exc, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
