"""What became of gpuyard's Slurm jobs: one squeue for all of them, scontrol and sacct for ended ones,
each row checked against the attempt, and the controller's silence kept apart from a job's end."""

from __future__ import annotations

import logging
import re
import shutil
import time
from dataclasses import replace
from datetime import datetime, timezone
from typing import Any

from gpuyard.scheduler.executors.base import ExecutorUnreachable, ExitStatus
from gpuyard.scheduler.executors.slurm_nodes import SlurmNodes
from gpuyard.scheduler.executors.slurm_states import (
    ACTIVE,
    SlurmExit,
    exit_from_state,
    parse_kv_line,
    parse_time,
)

log = logging.getLogger("gpuyard.scheduler.executors.slurm")  # the executor's log, as before the split

STATES_TTL_S = 1.0  # how old the one squeue of all this server's jobs may be when a job is polled
# While the controller does not answer, how often gpuyard asks again (one squeue for all jobs).
UNREACHABLE_RETRY_S = 5.0
# How far Slurm's SubmitTime of an attempt may be from the moments gpuyard's sbatch began and returned
# (the controller's clock against the server's): a row outside that is another job under a reused id.
SUBMIT_SKEW_S = 60.0
# How long the end of an attempt that did not succeed is held back while a node of it does not answer
# (its slurmd may still run the attempt's tasks there, and a retry would run beside them).
SILENT_NODE_WAIT_S = 120.0  # well inside MinJobAge (300 s by default), while scontrol still has the end


class SlurmPolling(SlurmNodes):
    """The Slurm executor's polling of its jobs' states, and its finding of them again."""

    # Whether the controller answered the last squeue ("" : it did; else why not) and since when.
    _down, _down_since = "", 0.0

    def _squeue(self, ids: list[str] | None) -> dict[str, dict[str, str]]:
        """squeue rows of ``ids``, or (None) of every job of this server (by its name prefix); an id
        Slurm does not know is left out.

        Raises:
            ExecutorUnreachable: squeue got no answer.
        """
        if ids == []:
            return {}
        which = ["-j", ",".join(ids)] if ids else []
        text = self._ask(["squeue", "-h", *which, "-o", "%i|%T|%r|%N|%S|%V|%j"])
        out: dict[str, dict[str, str]] = {}
        for line in text.splitlines():
            parts = line.split("|", 6)
            if len(parts) == 7 and (ids or parts[6].startswith(self.prefix)):
                # A heterogeneous job is listed once per component (``123+0``, ``123+1``): it is
                # known by its first component's id, and that component's row stands for it.
                job, _, offset = parts[0].partition("+")
                if offset in ("", "0") or job not in out:
                    out[job] = {
                        "state": parts[1],
                        "reason": parts[2],
                        "nodes": parts[3],
                        "start": parts[4],
                        "submit": parts[5],
                        "name": parts[6],
                    }
        return out

    def _refresh_states(self) -> None:
        """One squeue of all this server's jobs; on no answer, remember why (and since when)."""
        self._states_at = time.monotonic()
        try:
            self._states = self._squeue(None)
        except ExecutorUnreachable as exc:
            self._note_down(str(exc))
            return
        if self._down:
            log.warning("Slurm's controller answers again after %.1f s", time.monotonic() - self._down_since)
        self._down = ""

    def _note_down(self, why: str) -> None:
        if not self._down:
            self._down_since = time.monotonic()
            log.warning("Slurm: %s; the states of gpuyard's Slurm jobs are unknown until it answers", why)
        self._down, self._states_at = why, time.monotonic()

    def unavailable(self) -> str | None:
        """Why nothing should be started or stopped on Slurm now (its controller does not answer), or
        None. Asks again every UNREACHABLE_RETRY_S while it does not."""
        if self._down and time.monotonic() - self._states_at >= UNREACHABLE_RETRY_S:
            self._refresh_states()
        if not self._down:
            return None
        return f"{self._down} (for {time.monotonic() - self._down_since:.0f} s)"

    def _check_reachable(self) -> None:
        """Raise at once, sending nothing, while the controller is known not to answer."""
        why = self.unavailable()
        if why is not None:
            raise ExecutorUnreachable(why, submitted=False)

    @staticmethod
    def _is_attempt(name: str, submit: str, handle: dict[str, Any]) -> bool:
        """Whether a Slurm row (its job name and submit time) is the attempt ``handle`` launched, not
        another job under the same id (Slurm reuses ids after its controller lost its state)."""
        want = handle.get("slurm_name")
        if want and name and name != want:
            return False
        window = handle.get("submit_window")
        when = parse_time(submit)
        if window and when is not None:
            at = when.timestamp()
            return float(window[0]) - SUBMIT_SKEW_S <= at <= float(window[1]) + SUBMIT_SKEW_S
        return True

    def describe_pending(self, handle: dict[str, Any]) -> str | None:
        """Why Slurm keeps a submitted job pending (its Reason), or None when it runs or ended."""
        row = self._squeue([str(handle.get("slurm_id", ""))]).get(str(handle.get("slurm_id")))
        return row["reason"] if row and row["state"] == "PENDING" else None

    def poll(self, handle: dict[str, Any]) -> ExitStatus | None:
        """None while Slurm has the job pending, running or still ending, and while Slurm does not
        answer (unknown: the job keeps its state); then how it ended (Slurm's reason too)."""
        slurm_id = str(handle.get("slurm_id", ""))
        if not slurm_id:
            return ExitStatus(code=None, lost=True)
        try:
            return self._poll(slurm_id, handle)
        except ExecutorUnreachable as exc:
            if not self._down:  # a single call failed while the controller otherwise answers
                log.warning("Slurm job %s: its state is unknown for now: %s", slurm_id, exc)
            return None

    def _poll(self, slurm_id: str, handle: dict[str, Any]) -> ExitStatus | None:
        now = time.monotonic()
        if now - self._states_at > (UNREACHABLE_RETRY_S if self._down else STATES_TTL_S):
            self._refresh_states()
        if self._down:
            raise ExecutorUnreachable(self._down)
        row = self._states.get(slurm_id)
        if row is not None and not self._is_attempt(row["name"], row["submit"], handle):
            row = None
        if row is None or row["state"] not in ACTIVE:
            row = self._squeue([slurm_id]).get(slurm_id)  # submitted since, or ended: ask for it alone
            if row is not None and not self._is_attempt(row["name"], row["submit"], handle):
                row = None
        if row is not None and row["state"] in ACTIVE:
            self._seen[slurm_id] = (row["state"], time.time())
            return None
        status = self._ended(slurm_id, handle)
        if status is not None:
            self._seen.pop(slurm_id, None)
        return status

    def _ended(self, slurm_id: str, handle: dict[str, Any] | None = None) -> ExitStatus | None:
        """How the attempt ended, from scontrol, else sacct; None while Slurm still ends it.

        Raises:
            ExecutorUnreachable: a tool got no answer.
        """
        handle = handle or {}
        text = self._ask(["scontrol", "show", "job", "-o", slurm_id])
        # One line per component of a heterogeneous job: the first component's (where the batch
        # script ran; its exit code is the job's) is the job's.
        rows = [parse_kv_line(line) for line in text.splitlines() if line.strip()]
        rows = [r for r in rows if self._is_attempt(r.get("JobName", ""), r.get("SubmitTime", ""), handle)]
        row = next((r for r in rows if r.get("JobId") == slurm_id), rows[0] if rows else {})
        if row.get("JobState"):
            if row["JobState"].split()[0] in ACTIVE:  # between squeue and scontrol: still ending
                return None
            status = exit_from_state(
                row["JobState"], row.get("ExitCode", "0:0"), row.get("EndTime", ""), row.get("Reason", "")
            )
            if status.code == 0:
                return status
            return self._when_nodes_answer(slurm_id, status, ",".join(r.get("NodeList", "") for r in rows))
        if shutil.which("sacct", path=self._env().get("PATH")):
            fields = "JobName,State,ExitCode,End,Submit"
            text = self._ask(["sacct", "-n", "-P", "-X", "-j", slurm_id, "-o", fields])
            for line in reversed(text.splitlines()):  # the newest record of that id first
                parts = line.split("|")
                if len(parts) == 5 and self._is_attempt(parts[0], parts[4], handle):
                    if parts[1].split()[0] in ACTIVE:
                        return None
                    return exit_from_state(parts[1], parts[2], parts[3])
        return SlurmExit(code=None, untraced=True, reason=self._no_trace(slurm_id, handle))

    def _when_nodes_answer(self, slurm_id: str, status: SlurmExit, nodelist: str) -> SlurmExit | None:
        """A failed attempt's end once every node of it answers Slurm again: a node whose slurmd does
        not answer (killed, hung) may still run the attempt's tasks, which Slurm cannot end there,
        and a retry would run beside them. When its slurmd is back it ends them itself (Slurm tells
        it the job is over). Held at most SILENT_NODE_WAIT_S; then the end carries a note naming
        the nodes."""
        names = [n for part in nodelist.split(",") for n in self.hostnames(part)] if nodelist else []
        states = {r["NodeName"]: r.get("State", "") for r in self.node_info()}
        silent = sorted(n for n in set(names) if "NOT_RESPONDING" in states.get(n, ""))
        if not silent:
            self._held.pop(slurm_id, None)
            return status
        first = slurm_id not in self._held
        now = time.monotonic()
        waited = now - self._held.setdefault(slurm_id, now)
        if waited < SILENT_NODE_WAIT_S:
            if first:
                log.warning(
                    "Slurm job %s ended (%s) but %s does not answer: its end waits for %s (at most %g s)",
                    slurm_id,
                    status.describe(),
                    ", ".join(silent),
                    "them" if len(silent) > 1 else "it",
                    SILENT_NODE_WAIT_S,
                )
            return None
        self._held.pop(slurm_id, None)
        note = (
            f"its tasks on {', '.join(silent)} may still run: Slurm has had no answer from "
            f"{'their' if len(silent) > 1 else 'its'} slurmd for {waited:.0f} s"
        )
        return replace(status, notes=(*status.notes, note))

    def _no_trace(self, slurm_id: str, handle: dict[str, Any]) -> str:
        """What is known of an attempt Slurm has no trace of (a controller that lost its state)."""
        facts = [f"Slurm job {slurm_id}"]
        if handle.get("slurm_name"):
            facts.append(f"named {handle['slurm_name']}")
        window = handle.get("submit_window")
        if window:
            at = datetime.fromtimestamp(float(window[0]), timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")
            facts.append(f"submitted {at}")
        seen = self._seen.get(slurm_id)
        if seen is not None:
            ago = max(0.0, time.time() - seen[1])
            facts.append(f"last seen {seen[0]} {ago:.0f} s ago")
        return f"lost: Slurm has no trace of the attempt ({', '.join(facts)}; no accounting kept)"

    def recover(self, job_id: int, plan_hint: dict[str, Any] | None) -> dict[str, Any] | None:
        """The handle of a submission the server did not get to record: found by its job name, among
        the jobs Slurm has queued or ended recently.

        Raises:
            ExecutorUnreachable: Slurm did not answer (whether it was submitted is unknown).
        """
        if not plan_hint or not plan_hint.get("slurm_name"):
            return None
        name = plan_hint["slurm_name"]
        ids = self._ask(["squeue", "-h", "-n", name, "-o", "%i"]).split()
        if not ids:
            rows = [parse_kv_line(x) for x in self._ask(["scontrol", "show", "job", "-o"]).splitlines()]
            ids = [r["JobId"] for r in rows if r.get("JobName") == name and r.get("JobId")]
        if not ids:
            return None
        return {**plan_hint, "slurm_id": ids[0].partition("+")[0], "launched": True}

    def pending_reasons(self) -> dict[int, str]:
        """gpuyard job id -> Slurm's reason, for gpuyard's jobs Slurm keeps pending."""
        text = self._call(["squeue", "-h", "-t", "PENDING", "-o", "%j|%r"], check=False)
        out = {}
        for line in text.splitlines():
            name, _, reason = line.partition("|")
            match = re.fullmatch(rf"{re.escape(self.prefix)}(\d+)-\d+", name)
            if match:
                out[int(match.group(1))] = reason
        return out

    def adopt(self) -> dict[str, str]:
        """gpuyard's jobs Slurm has now: name -> Slurm id (what a restarted server can find)."""
        text = self._call(["squeue", "-h", "-o", "%j|%i"], check=False)
        out = {}
        for line in text.splitlines():
            name, _, sid = line.partition("|")
            if name.startswith(self.prefix):
                out[name] = sid.partition("+")[0]  # a heterogeneous job's first component
        return out
