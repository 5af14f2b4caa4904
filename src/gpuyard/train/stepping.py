"""One optimizer step of the trainer, and the ranks' agreement on its loss.

A step runs forward and backward over its micro-batches (counting right predictions on the way for a
classifier, so its accuracy is logged beside its loss), clips, and applies the update; then one
all-reduce tells every rank the mean loss, whether any rank diverged or must stop and, with straggler
detection, every rank's step times.
"""

from __future__ import annotations

import math
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from gpuyard.train.data import count_batch, split_batch, to_device
from gpuyard.train.goodput import step_waits
from gpuyard.train.parallel import clip_grad_norm, gradient_sync
from gpuyard.train.step import apply_update, batch_loss, step_scale, token_weighted
from gpuyard.train.straggler import StepTimes
from gpuyard.train.trainer_state import TrainerState
from gpuyard.train.validation import accuracy_counts, drive_pipeline, is_classification

__all__ = ["Stepping"]


class Stepping(TrainerState):
    """The trainer's step (:meth:`_train_step`) and loss agreement (:meth:`_agree`)."""

    def _train_step(self, micro: list[Any]) -> tuple[torch.Tensor, int, int]:
        """Forward, backward and update over `micro` batches; returns (loss, samples, tokens) of this rank."""
        d = self.spec.data
        total = torch.zeros((), device=self.ctx.device)
        samples = tokens = 0
        # [right predictions, counted labels] (one tensor: one device sync in _agree), batches not
        # classification
        self._counts = [None, 0]
        parts = [split_batch(batch, d.input_key, d.target_key) for batch in micro]
        # A token-weighted loss (lm_loss): each micro-batch's sum over the step's count on all dp
        # ranks, not a mean of means (packed batches count different numbers of labels).
        scale = None
        if self.pipeline is None and token_weighted(self.loss_fn):
            counts = [int(self.loss_fn.count(targets)) for _, targets in parts]  # type: ignore[attr-defined]
            dp = self.ctx.layout.dp
            scale = step_scale(counts, dp, self.ctx.group("dp") if dp > 1 else None, self.ctx.device)
        for i, (inputs, targets) in enumerate(parts):
            n, t = count_batch(inputs)
            samples, tokens = samples + n, tokens + t
            inputs, targets = to_device(inputs, self.ctx.device), to_device(targets, self.ctx.device)
            if self.pipeline is not None:
                total = total + self._pipeline_step(inputs, targets)
                continue
            with gradient_sync(self.model, i == len(micro) - 1), self._autocast():
                if scale is None:
                    loss = batch_loss(self.model, self._counting_loss, inputs, targets, parts=len(micro))
                else:
                    loss = self._counting_loss(self.model(inputs), targets, summed=True) * scale
            loss.backward()
            if self._comm_timer is not None and i == len(micro) - 1:
                self._comm_wait = self._comm_timer.wait_since_launch()
            total = loss.detach() if len(micro) == 1 else total + loss.detach()
        if self.spec.clip_grad_norm:
            self.last_grad_norm = clip_grad_norm(
                list(self.model.parameters()), self.spec.clip_grad_norm, self.ctx
            )
            if not math.isfinite(self.last_grad_norm):
                # A finite loss with inf/NaN gradients: do not let the update poison the weights;
                # report the step as diverged (the loss check below sees the NaN).
                self.optimizer.zero_grad(set_to_none=True)
                return torch.full((), float("nan"), device=self.ctx.device), samples, tokens
        if self.memory is not None:
            waited = self.memory.before_update()  # the last snapshot's copy of what the step changes
            if waited > 0.0005:
                self._event("memory_snapshot_wait", step=self.step, seconds=round(waited, 6))
        apply_update(self.optimizer, self.scheduler)
        return total, samples, tokens

    def _counting_loss(self, outputs: Any, targets: Any, summed: bool = False) -> torch.Tensor:
        """The loss, counting right predictions on the way when the task is classification (class
        scores against integer labels): the step's ``accuracy`` is logged beside its loss."""
        if is_classification(outputs, targets):
            pair = accuracy_counts(outputs, targets)
            self._counts[0] = pair if self._counts[0] is None else self._counts[0] + pair
        else:
            self._counts[1] += 1
        if summed:
            return self.loss_fn.total(outputs, targets)  # type: ignore[attr-defined]
        return self.loss_fn(outputs, targets)

    def _pipeline_step(self, inputs: Any, targets: Any) -> torch.Tensor:
        if self.pipeline is None:
            raise RuntimeError("_pipeline_step without a pipeline")
        with self._autocast():
            losses = drive_pipeline(self.pipeline, inputs, targets, "step")
        if not losses:
            return torch.zeros((), device=self.ctx.device)
        return torch.stack([loss.detach().float() for loss in losses]).mean()

    def _agree(self, loss: torch.Tensor, data_s: float = 0.0, start: float = 0.0) -> tuple[float, bool, bool]:
        """One all-reduce: mean loss over loss-owning ranks, and whether any rank diverged or must stop.

        With straggler detection on, the same all-reduce carries every rank's step times (`data_s`
        waiting for batches; compute from `start`, after the batches, to the loss on the host,
        less the gradient all-reduce wait).
        """
        value = float(loss.item())  # one device sync per step: the loss is logged every step anyway
        self._waits = (data_s, 0.0)
        counts = self._counts
        right, labels = (0.0, 0.0) if counts[0] is None else counts[0].tolist()
        other = float(counts[1])
        self._step_accuracy = None
        if self.ctx.world_size == 1:
            if labels and not other:
                self._step_accuracy = right / labels
            return value, not math.isfinite(value), self.stop_requested
        owner = 1.0 if self.ctx.is_loss_owner else 0.0
        bad = float(owner and not math.isfinite(value))
        stop = 1.0 if self.stop_requested else 0.0
        # Right predictions and labels of the loss owners (each sample counted once), summed.
        head = [0.0 if bad else value * owner, owner, bad, stop, right * owner, labels * owner, other * owner]
        timed = self.spec.straggler.enabled
        if timed:
            compute = max(0.0, time.perf_counter() - start - self._comm_wait)
            times = [0.0] * (3 * self.ctx.world_size)
            r = 3 * self.ctx.rank
            times[r : r + 3] = [data_s, compute, self._comm_wait + self._agree_wait]
            self._comm_wait = 0.0
            head += times
        vec = torch.tensor(head, device=self.ctx.device)
        began = time.perf_counter()
        dist.all_reduce(vec)
        self._agree_wait = time.perf_counter() - began
        values = vec.tolist()
        total, owners, any_bad, any_stop = values[:4]
        if values[5] and not values[6]:
            self._step_accuracy = values[4] / values[5]
        if timed and self.stragglers is not None:
            self._observe_times(values[7:])
        if timed and self.ctx.rank == 0:
            flat, s = values[7:], self.spec.straggler
            data = flat[0::3]
            own = [d + c for d, c in zip(data, flat[1::3], strict=True)]
            self._waits = step_waits(data, own, s.slowdown, s.min_seconds)
        return (float("nan") if any_bad else total / max(owners, 1.0)), bool(any_bad), bool(any_stop)

    def _observe_times(self, flat: list[float]) -> None:
        if self.stragglers is None:
            return
        times = [StepTimes(*flat[i : i + 3]) for i in range(0, len(flat), 3)]
        for found in self.stragglers.observe(self.step, times):
            self._event("straggler", **found.as_dict())
            print(f"gpuyard train: {found.message()}", file=sys.stderr, flush=True)
            if self._reporter is not None:
                self._reporter.report(found)
