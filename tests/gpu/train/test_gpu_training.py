"""On a CUDA GPU: bf16 autocast by default, GPU memory/utilization/MFU metrics, exact resume on the GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gpuyard.train import examples as ex
from gpuyard.train.spec import TrainSpec
from gpuyard.train.trainer import Trainer

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def _spec(run_dir: Path, **fields: object) -> TrainSpec:
    return TrainSpec.model_validate(
        {
            "run_dir": str(run_dir),
            "epochs": 1,
            "data": {"batch_size": 16},
            "optimizer": {"lr": 1e-3},
            "checkpoint": {"every_steps": 2},
            **fields,
        }
    )


def _model() -> torch.nn.Module:
    return ex.TinyTransformer(vocab=64, dim=64, heads=4, layers=2, seq_len=16)


def test_auto_precision_is_bf16_on_cuda_and_reports_device_metrics(tmp_path: Path) -> None:
    trainer = Trainer(_spec(tmp_path), model=_model, train_data=ex.token_data(128, seq_len=16, vocab=64))
    result = trainer.fit()
    assert trainer.use_bf16 and next(trainer.model.parameters()).is_cuda
    assert result.status == "completed" and torch.isfinite(torch.tensor(result.metrics["loss"]))
    assert result.metrics["gpu_mem_gb"] > 0
    if trainer.peak_tflops:  # a GPU the catalog knows
        assert 0 < result.metrics["mfu"] < 1


def test_exact_resume_on_gpu_in_fp32(tmp_path: Path) -> None:
    data = lambda: ex.token_data(128, seq_len=16, vocab=64)  # noqa: E731
    whole = Trainer(_spec(tmp_path / "a", precision="fp32", seed=1), model=_model, train_data=data())
    whole.fit()

    def stop(trainer: Trainer, event: str) -> None:
        if event == "step" and trainer.step == 3:
            trainer.request_stop()

    Trainer(
        _spec(tmp_path / "b", precision="fp32", seed=1), model=_model, train_data=data(), callbacks=[stop]
    ).fit()
    resumed = Trainer(_spec(tmp_path / "b", precision="fp32", seed=1), model=_model, train_data=data())
    resumed.fit()
    for (name, a), (_, b) in zip(
        whole.model.state_dict().items(), resumed.model.state_dict().items(), strict=True
    ):
        # cuDNN/cuBLAS may pick different kernels across processes; within one process they match.
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0, msg=name)
