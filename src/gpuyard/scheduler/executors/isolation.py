"""How `gpuyard server` keeps a job away from the server: its Unix user, its environment, its folder.

A job is a member's code. Under `gpuyard server` the local executor runs it

- as an unprivileged Unix user (``--job-user``; by default ``gpuyard-job`` when the server runs as
  root). The job's process is started by the shim, which stays the server's user to write the pid
  and exit files; the command itself changes user before it enters its working directory;
- with an allow-listed environment (:data:`PASSED_VARS` from the server's, the job's HOME, USER
  and LOGNAME, and the variables gpuyard sets for the job and the spec's own ``env``): never
  GPUYARD_TOKEN, GPUYARD_DATABASE_URL or any other variable of the server;
- in a working directory of its own (``WORK_ROOT/job-ID``, owned by the job's user, mode 0700),
  unless the spec names one;
- while GPUYARD_HOME is 0700 and the database and token files 0600, so the job's user cannot read
  them.

When the server is not root it cannot change user: jobs then run as the server's user, which can read
everything the server can (its home, and its environment through /proc). That is the single-user
mode, said once at startup; the environment and working directory rules still apply, and the job
gets the store's location (GPUYARD_HOME, GPUYARD_DATABASE_URL, GPUYARD_ARTIFACTS) so gpuyard's own
jobs (``gpuyard train``'s tracking, GPU deployments) find the state they could read anyway.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
import stat
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from gpuyard import privileged
from gpuyard.errors import ConfigError
from gpuyard.settings import ARTIFACTS_ENV, DATABASE_ENV, HOME_ENV, SERVER_ENV, Settings

if TYPE_CHECKING:
    from gpuyard.scheduler.executors.limits import Confinement

log = logging.getLogger(__name__)

DEFAULT_JOB_USER = "gpuyard-job"
# Taken from the server's environment when set; nothing else of it reaches a job.
PASSED_VARS = ("PATH", "LANG", "LC_ALL", "LC_CTYPE", "TZ")
# The store's location: passed only to jobs that run as the server's user (they can read it anyway).
STORE_VARS = (HOME_ENV, DATABASE_ENV, ARTIFACTS_ENV)
FALLBACK_PATH = "/usr/local/bin:/usr/bin:/bin"
# The temp folder and the caches the field's tools keep compiled or downloaded code in: set for every
# job to a private folder of its own (a subfolder of it, or itself for ""), unless its spec sets one.
# A shared /tmp would otherwise let one team prepare another team's torch.compile or Triton cache.
TMP_ENV = "TMPDIR"
PRIVATE_TMP_VARS = {
    TMP_ENV: "",
    "TORCHINDUCTOR_CACHE_DIR": "torchinductor",
    "TRITON_CACHE_DIR": "triton",
    "CUDA_CACHE_PATH": "nv",
    "HF_HOME": "huggingface",
    "XDG_CACHE_HOME": "cache",
}


def private_tmp_env(folder: str | Path, job_vars: dict[str, str]) -> dict[str, str]:
    """:data:`PRIVATE_TMP_VARS` pointing into ``folder``, but those ``job_vars`` set already."""
    return {
        key: os.path.join(folder, sub) if sub else str(folder)
        for key, sub in PRIVATE_TMP_VARS.items()
        if key not in job_vars
    }


@dataclass(frozen=True)
class JobIsolation:
    """The user, environment and folders of `gpuyard server`'s jobs.

    Attributes:
        user: the Unix user jobs run as.
        uid, gid: its ids.
        switch: True when jobs change to ``user`` (the server is root and ``user`` is not the server's).
        work_root: the folder holding each job's working directory (``job-ID``).
        home: the job user's home when it has one of its own (else the job's working directory is its
            HOME).
        store_env: the store's location variables, given to jobs only when they run as the server's user.
        server_url: the API's URL (GPUYARD_SERVER), for a job that brings its own token.
        python: the interpreter jobs are given (``gpuyard train`` of a training spec), checked to run
            as the job's user.
        confinement: the jobs' limits, private mounts and log cap (:mod:`.limits`); None: none.
    """

    user: str
    uid: int
    gid: int
    switch: bool
    work_root: Path
    home: str | None = None
    store_env: tuple[tuple[str, str], ...] = ()
    server_url: str | None = None
    template: str | None = None
    python: str = sys.executable
    confinement: Confinement | None = None

    def for_job(self, team: str, user: str) -> JobIsolation:
        """The isolation of one job: with a ``--job-user`` template (``gpuyard-{team}``,
        ``gpuyard-{user}``) its team's or submitter's own Unix user, else this one.

        Jobs of different teams (or users) then cannot signal, trace or read each other's processes
        and files, as Slurm runs each job as its submitter.

        Raises:
            ConfigError: the Unix user the template names for this job does not exist (one line).
        """
        if self.template is None:
            return self
        name = self.template.format(team=team, user=user)
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            whose = f"team {team!r}" if "{team}" in self.template else f"user {user!r}"
            raise ConfigError(
                f"no Unix user {name!r} to run the jobs of {whose} (server option --job-user "
                f"{self.template}): create it, e.g. useradd --system --no-create-home {name}"
            ) from None
        if entry.pw_uid == 0:
            raise ConfigError(f"--job-user {self.template}: {name!r} is root; jobs never run as root")
        own_home = entry.pw_dir if _owned_dir(entry.pw_dir, entry.pw_uid) else None
        return replace(
            self, user=entry.pw_name, uid=entry.pw_uid, gid=entry.pw_gid, home=own_home, template=None
        )

    def check_python(self) -> None:
        """Refuse (one line) when this job's user cannot run the Python jobs are given; checked once
        per user. A ``--job-user`` template's users are known only per job: their training jobs (the
        jobs gpuyard gives its Python) are checked at launch, and fail with this reason.

        Raises:
            ConfigError: the user cannot run :attr:`python`.
        """
        if not self.switch or self.uid in _PYTHON_OK:
            return
        problem = _python_problem(self.uid, self.gid, self.python)
        if problem is not None:
            raise ConfigError(
                _python_refusal(self.user, problem, self.python, pwd.getpwuid(os.geteuid()).pw_name)
            )
        _PYTHON_OK.add(self.uid)

    def workdir(self, job_id: int) -> Path:
        """The default working directory of job ``job_id``."""
        return self.work_root / f"job-{job_id}"

    def environment(self, job_vars: dict[str, str], cwd: str) -> dict[str, str]:
        """The job's whole environment: the allow-list, the job's HOME and user, then ``job_vars``."""
        env = {k: os.environ[k] for k in PASSED_VARS if os.environ.get(k)}
        env.setdefault("PATH", FALLBACK_PATH)
        env.update(HOME=self.home or cwd, USER=self.user, LOGNAME=self.user)
        if self.server_url:
            env[SERVER_ENV] = self.server_url
        env.update(dict(self.store_env))
        env.update(job_vars)
        return env

    def describe(self) -> str:
        """One line for the startup log: who jobs run as, and what that protects (and their limits)."""
        limits = f"; {self.confinement.describe()}" if self.confinement is not None else ""
        if self.template is not None:
            return (
                f"jobs run as user {self.template} (one Unix user per {_template_key(self.template)}) in "
                f"{self.work_root}, environment allow-listed, GPUYARD_HOME 0700{limits}"
            )
        if self.switch:
            return (
                f"jobs run as user {self.user} (uid {self.uid}) in {self.work_root}, "
                f"environment allow-listed, GPUYARD_HOME 0700{limits}"
            )
        # A root server told to run jobs as root needs another --job-user, not to be started as root.
        fix = (
            "pass an unprivileged --job-user to run them as that user"
            if os.geteuid() == 0
            else "start the server as root to run them as an unprivileged --job-user"
        )
        return (
            f"jobs run as the server's user {self.user}: NOT isolated from GPUYARD_HOME, the database "
            f"or the token ({fix}); environment allow-listed{limits}"
        )

    def tmpdir(self, job_id: int, attempt: int, tag: str) -> Path:
        """The private temp folder of one attempt (made by :meth:`make_tmp`, removed at its end)."""
        return self.work_root / f".tmp-{job_id}-{attempt}-{tag}"

    def make_tmp(self, path: Path) -> None:
        """Create an attempt's temp folder: the job user's, 0700, never an existing one.

        Raises:
            ConfigError: something is there already (refused, not reused).
        """
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            raise ConfigError(f"job temp folder {path} exists already: refused") from None
        if self.switch:
            os.chown(path, self.uid, self.gid)
        os.chmod(path, 0o700)

    def prepare(self, job_id: int, cwd: str) -> None:
        """Create the job's default working directory (owned by the job's user, 0700) if ``cwd`` is it."""
        if cwd != str(self.workdir(job_id)):
            return
        path = Path(cwd)
        try:
            path.mkdir(mode=0o700)
        except FileExistsError:
            st = path.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != self.uid:
                raise ConfigError(f"job folder {path} exists and is not a directory of {self.user}") from None
            return  # a restart or a resume: the job finds its files again
        if self.switch:
            os.chown(path, self.uid, self.gid)
        os.chmod(path, 0o700)


def resolve_isolation(
    settings: Settings, job_user: str | None, work_root: str | None = None, python: str | None = None
) -> JobIsolation:
    """The isolation of `gpuyard server`'s jobs, checked; GPUYARD_HOME and its files made private.

    Args:
        settings: the server's settings (its home is made 0700, its SQLite file and token 0600).
        job_user: the Unix user jobs run as; None: ``gpuyard-job`` when the server is root, else the
            server's own user (single-user mode).
        work_root: the folder of the jobs' working directories (default: for a job user, a folder of
            unpredictable name made in the system's temp folder and recorded in GPUYARD_HOME, so later
            servers find it again; for the server's own user, GPUYARD_HOME/work).
        python: the interpreter jobs are given (default: the server's); a job user must be able to run it.

    Raises:
        ConfigError: the job user does not exist, is root while the server is not, or the server is
            not root and was asked to run jobs as another user; or the job user cannot run ``python``;
            or the work root is unsafe (not a folder of the server's user, writable by others, a link).
    """
    me = pwd.getpwuid(os.geteuid())
    root = os.geteuid() == 0
    python = python or sys.executable
    if job_user is not None and "{" in job_user:
        return replace(_templated(settings, job_user, work_root, root), python=python)
    name = job_user if job_user is not None else (DEFAULT_JOB_USER if root else me.pw_name)
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        hint = f"useradd --system --no-create-home {name}" if name == DEFAULT_JOB_USER else "create it"
        raise ConfigError(
            f"job user {name!r} does not exist: {hint}, or pass --job-user NAME "
            f"(--job-user {me.pw_name} runs jobs as the server's user, not isolated)"
        ) from None
    if entry.pw_uid != me.pw_uid and not root:
        raise ConfigError(
            f"--job-user {name}: the server runs as {me.pw_name}, not root, so it cannot start jobs as "
            f"another user; leave --job-user out to run them as {me.pw_name} (not isolated)"
        )
    switch = entry.pw_uid != me.pw_uid
    problem = _python_problem(entry.pw_uid, entry.pw_gid, python) if switch else None
    if problem is not None:
        raise ConfigError(_python_refusal(entry.pw_name, problem, python, me.pw_name))
    home = settings.ensure_home()
    _make_private(settings)
    if work_root is not None:
        folder = Path(os.path.abspath(os.path.expanduser(work_root)))  # a link is refused, not followed
        _make_work_root(folder, traverse=switch)
    elif switch:
        folder = _private_work_root(home)
    else:
        folder = home / "work"
        _make_work_root(folder, traverse=False)
    own_home = entry.pw_dir if switch and _owned_dir(entry.pw_dir, entry.pw_uid) else None
    return JobIsolation(
        user=entry.pw_name,
        uid=entry.pw_uid,
        gid=entry.pw_gid,
        switch=switch,
        work_root=folder,
        home=own_home if switch else me.pw_dir,
        store_env=() if switch else _store_env(settings),
        server_url=os.environ.get(SERVER_ENV) or None,
        python=python,
    )


# Job users (uids) seen to run the jobs' Python: a --job-user template checks each user once.
_PYTHON_OK: set[int] = set()
WORK_ROOT_RECORD = "work-root"  # in GPUYARD_HOME: the path of the default work root


def _private_work_root(home: Path) -> Path:
    """The default work root of a job user: made with ``mkdtemp`` (a name nobody can plant beforehand)
    in the temp folder, its path recorded in GPUYARD_HOME; a later server takes the recorded one back
    after checking it is still the server's own folder (not a link, not writable by others)."""
    record = home / WORK_ROOT_RECORD
    try:
        recorded = record.read_text().strip()
    except FileNotFoundError:
        recorded = ""
    if recorded and os.path.lexists(recorded):
        folder = Path(recorded)
        _make_work_root(folder, traverse=True)  # refuses one that is not the server's any more
        return folder
    folder = Path(tempfile.mkdtemp(prefix="gpuyard-jobs-"))
    _make_work_root(folder, traverse=True)
    fd = os.open(record.with_name(record.name + ".tmp"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(str(folder))
    os.replace(record.with_name(record.name + ".tmp"), record)
    return folder


def _python_refusal(user: str, problem: str, python: str, server_user: str) -> str:
    """The one-line refusal when the job user cannot run the jobs' Python, with the ways out."""
    return (
        f"job user {user} cannot run the Python jobs are given ({problem}): make {python} and its "
        f"installation readable by {user} (e.g. install Python and gpuyard under /opt{_blocker(python)}), "
        f"or give jobs another interpreter with --job-python PATH, or run jobs as the server's user "
        f"with --job-user {server_user} (not isolated)"
    )


def _blocker(python: str) -> str:
    """``, or chmod o+x /root`` when a folder on the way to ``python`` lets no other user pass."""
    for path in (Path(python), Path(os.path.realpath(python))):
        for parent in reversed(path.parents):
            try:
                mode = parent.stat().st_mode
            except OSError:
                continue
            if not mode & 0o001:
                return f", or chmod o+x {parent} (now {stat.filemode(mode)})"
    return ""


def _python_problem(uid: int, gid: int, python: str | None = None) -> str | None:
    """Why ``uid`` cannot start ``python`` (default: the server's interpreter), e.g. a virtual
    environment under /root; None when it can."""
    import subprocess

    python = python or sys.executable
    try:
        proc = subprocess.run(
            [python, "-I", "-S", "-c", "pass"],
            user=uid,
            group=gid,
            extra_groups=[],
            cwd="/",
            env=privileged.environment(),
            capture_output=True,
            timeout=30,
            check=False,
        )
    except OSError as exc:
        return f"{python}: {exc.strerror}"
    except subprocess.TimeoutExpired:
        return f"{python} did not start within 30 s"
    if proc.returncode != 0:
        last = (
            proc.stderr.decode(errors="replace").strip().splitlines() or ["exit " + str(proc.returncode)]
        )[-1]
        return f"{python}: {last}"
    return None


def _store_env(settings: Settings) -> tuple[tuple[str, str], ...]:
    return (
        (HOME_ENV, str(settings.home)),
        (DATABASE_ENV, settings.database_url),
        (ARTIFACTS_ENV, settings.artifact_root),
    )


def _make_private(settings: Settings) -> None:
    """GPUYARD_HOME 0700; the SQLite file (and its journal files) and the token file 0600."""
    os.chmod(settings.home, 0o700)
    names = ["token"]
    if settings.is_sqlite:
        db = Path(settings.database_url.split(":///", 1)[-1])
        names = [*names, *(str(db) + sfx for sfx in ("", "-wal", "-shm", "-journal"))]
    for name in names:
        path = settings.home / name
        try:
            if not path.is_symlink() and path.is_file():
                os.chmod(path, 0o600)
        except FileNotFoundError:
            continue


def _make_work_root(folder: Path, traverse: bool) -> None:
    """Create the work root owned by the server: 0711 (the job's user passes through, lists nothing).

    An existing one must be a folder (not a link) of the server's user that others cannot write: a
    folder planted beforehand by someone else is refused, in one line naming it.
    """
    with contextlib.suppress(FileExistsError):
        folder.mkdir(parents=True, mode=0o700)
    st = folder.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        what = "a link" if stat.S_ISLNK(st.st_mode) else f"owner uid {st.st_uid}, {stat.filemode(st.st_mode)}"
        raise ConfigError(
            f"job folder root {folder} ({what}) is not a folder of the server's user closed to others: "
            "refused (planted by someone else?); remove it or choose another --job-dir"
        )
    os.chmod(folder, 0o711 if traverse else 0o700)
    if traverse:
        # The job's user must reach the root: every folder above it must let others pass.
        for parent in folder.parents:
            if not parent.stat().st_mode & 0o001:
                raise ConfigError(
                    f"job folder root {folder}: {parent} does not let other users pass (chmod o+x, "
                    "or choose another --job-dir)"
                )


def _owned_dir(path: str, uid: int) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == uid


def _template_key(template: str) -> str:
    return "team" if "{team}" in template else "submitting user"


def _templated(settings: Settings, template: str, work_root: str | None, root: bool) -> JobIsolation:
    """The isolation for a ``--job-user`` template: each job's user is resolved when it is submitted."""
    try:
        sample = template.format(team="t", user="u")
    except (KeyError, IndexError, ValueError):
        sample = ""
    if sample == template or not sample or not any(k in template for k in ("{team}", "{user}")):
        raise ConfigError(
            f"--job-user {template}: a template names {{team}} or {{user}} and nothing else in braces "
            "(e.g. gpuyard-{team})"
        )
    if not root:
        raise ConfigError(
            f"--job-user {template}: running jobs as other users needs a server started as root"
        )
    home = settings.ensure_home()
    _make_private(settings)
    if work_root is not None:
        folder = Path(os.path.abspath(os.path.expanduser(work_root)))  # a link is refused, not followed
        _make_work_root(folder, traverse=True)
    else:
        folder = _private_work_root(home)
    return JobIsolation(
        user=template,
        uid=-1,
        gid=-1,
        switch=True,
        work_root=folder,
        server_url=os.environ.get(SERVER_ENV) or None,
        template=template,
    )
