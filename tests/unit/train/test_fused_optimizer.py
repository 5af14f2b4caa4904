"""The trainer's Adam(W) runs the fused kernel on plain tensors and the same update as the foreach path."""

from __future__ import annotations

import pytest
import torch

from gpuyard.train.components import build_optimizer
from gpuyard.train.spec import OptimizerSpec

pytestmark = pytest.mark.unit


def _params(seed: int) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(8, 4, generator=g)),
        torch.nn.Parameter(torch.randn(4, generator=g)),
    ]


@pytest.mark.parametrize("name", ["adamw", "adam"])
def test_plain_cpu_parameters_get_the_fused_kernel_with_the_same_update(name: str) -> None:
    spec = OptimizerSpec(name=name, lr=1e-2, weight_decay=0.1)
    fused_params, reference = _params(0), _params(0)
    fused = build_optimizer(fused_params, spec)
    assert all(g.get("fused") for g in fused.param_groups)
    plain = (torch.optim.AdamW if name == "adamw" else torch.optim.Adam)(
        [{"params": [reference[0]], "weight_decay": 0.1}, {"params": [reference[1]], "weight_decay": 0.0}],
        lr=1e-2,
        foreach=True,
    )
    for step in range(3):
        g = torch.Generator().manual_seed(100 + step)
        for a, b in zip(fused_params, reference, strict=True):
            a.grad = torch.randn(a.shape, generator=g)
            b.grad = a.grad.clone()
        fused.step()
        plain.step()
    for a, b in zip(fused_params, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_sgd_is_untouched_and_frozen_params_are_left_out() -> None:
    sgd = build_optimizer(_params(1), OptimizerSpec(name="sgd", lr=0.1))
    assert isinstance(sgd, torch.optim.SGD)
    frozen = _params(2)
    frozen[1].requires_grad_(False)
    opt = build_optimizer(frozen, OptimizerSpec())
    assert sum(len(g["params"]) for g in opt.param_groups) == 1
