"""Built-in model factories and train functions: a small PyTorch MLP and any scikit-learn estimator.

A train function has the signature ``fn(params, data, ctx) -> model``: it fits on ``data.X_train`` /
``data.y_train``, may call ``ctx.report(step, value)`` with the validation metric after each epoch
(that is what pruning looks at; it raises :class:`Pruned` when the search stops the trial), and returns
a torch module built by a factory, or a fitted scikit-learn estimator. Users write their own with the
same signature and name it as ``package.module:function`` in a spec.

Only the MLP has steps to share with the training runtime (:mod:`gpuyard.train.step`); a
scikit-learn estimator is fitted whole by its own ``fit`` (no batches, no optimizer), so
:func:`train_sklearn` shares the context and the scoring, not a loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from gpuyard.errors import ConfigError
from gpuyard.models.datasets import Splits
from gpuyard.models.flavors import FACTORY_ATTR, as_predictor
from gpuyard.models.metrics import compute
from gpuyard.refs import import_ref


class Pruned(Exception):
    """Raised by ``ctx.report`` when the search decides to stop this trial early."""


@dataclass
class TrainContext:
    """What a train function may use besides its params and data.

    Attributes:
        task: classification or regression.
        metric: the metric reported to ``report`` (the search's objective).
        seed: the random seed to use.
        reporter: called with (step, value); raises Pruned to stop.
        log: called with (step, {name: value}) to record per-epoch metrics in the run.
    """

    task: str
    metric: str
    seed: int = 0
    reporter: Callable[[int, float], None] | None = None
    log: Callable[[int, dict[str, float]], None] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def report(self, step: int, value: float) -> None:
        """Report the validation metric at ``step``; may raise :class:`Pruned`."""
        if self.log is not None:
            self.log(step, {f"validation/{self.metric}": value})
        if self.reporter is not None:
            self.reporter(step, value)

    def score(self, model: Any, X: np.ndarray, y: np.ndarray) -> float:
        """The objective metric of ``model`` on ``(X, y)``."""
        predictor = as_predictor(model, self.task)
        proba = predictor.predict_proba(X) if self.metric in ("roc_auc", "log_loss") else None
        return compute(self.metric, y, predictor.predict(X), proba)


def mlp(
    in_features: int,
    out_features: int,
    hidden: int = 64,
    layers: int = 1,
    dropout: float = 0.0,
    activation: str = "relu",
) -> Any:
    """A standardize -> (Linear -> activation -> dropout) x layers -> Linear network.

    The input mean and std are buffers of the first layer (saved with the weights), so the stored
    model takes raw features. Set on the module: the factory reference that rebuilds it.
    """
    import torch
    from torch import nn

    acts = {"relu": nn.ReLU, "tanh": nn.Tanh, "gelu": nn.GELU}
    if activation not in acts:
        raise ConfigError(f"mlp activation {activation!r}: use one of {', '.join(acts)}")
    if in_features < 1 or out_features < 1 or hidden < 1 or layers < 0:
        raise ConfigError("mlp needs in_features, out_features, hidden >= 1 and layers >= 0")

    class Standardize(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.register_buffer("mean", torch.zeros(n))
            self.register_buffer("std", torch.ones(n))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (x - self.mean) / self.std  # type: ignore[operator]

    mods: list[nn.Module] = [Standardize(in_features)]
    width = in_features
    for _ in range(layers):
        mods += [nn.Linear(width, hidden), acts[activation]()]
        if dropout > 0:
            mods.append(nn.Dropout(dropout))
        width = hidden
    mods.append(nn.Linear(width, out_features))
    net = nn.Sequential(*mods)
    kwargs: dict[str, Any] = dict(
        in_features=in_features, out_features=out_features, hidden=hidden, layers=layers
    )
    kwargs |= dict(dropout=dropout, activation=activation)
    setattr(net, FACTORY_ATTR, {"factory": "gpuyard.models.builtin:mlp", "kwargs": kwargs})
    return net


def train_mlp(params: dict[str, Any], data: Splits, ctx: TrainContext) -> Any:
    """Train :func:`mlp` with AdamW on mini-batches; report the validation metric every epoch.

    Params: ``hidden`` (64), ``layers`` (1), ``dropout`` (0), ``activation`` (relu), ``lr`` (1e-2),
    ``weight_decay`` (0), ``epochs`` (20), ``batch_size`` (64).

    Each step is the training runtime's (:mod:`gpuyard.train.step`: the batch's loss, backward, the
    update); the loop around it is not :class:`gpuyard.train.trainer.Trainer`'s, because the two do
    different jobs. This one fits a trial of a search in the calling process on arrays already in
    memory, in epochs, and reports the validation metric after each so the search can prune the trial
    (:class:`Pruned`); hundreds of trials run back to back in one worker. The trainer runs a
    ``TrainSpec`` under torchrun: data sources, device meshes, checkpoints and resume, signals, a run
    folder and its trackers, stops by step count; its set-up alone would outlast a trial here.
    """
    import torch
    from torch import nn

    from gpuyard.train.step import apply_update, batch_loss

    torch.manual_seed(ctx.seed)
    X = torch.as_tensor(data.X_train, dtype=torch.float32)
    classify = ctx.task == "classification"
    y = torch.as_tensor(data.y_train, dtype=torch.long if classify else torch.float32)
    out = int(max(data.y_train.max(), data.y_val.max() if len(data.y_val) else 0)) + 1 if classify else 1
    net = mlp(
        X.shape[1],
        out,
        hidden=int(params.get("hidden", 64)),
        layers=int(params.get("layers", 1)),
        dropout=float(params.get("dropout", 0.0)),
        activation=str(params.get("activation", "relu")),
    )
    net[0].mean.copy_(X.mean(0))
    std = X.std(0)
    # Constant features (digits' blank border pixels) keep scale 1: dividing by ~0 would blow up any
    # value the training set never showed.
    net[0].std.copy_(torch.where(std < 1e-3, torch.ones_like(std), std))
    opt = torch.optim.AdamW(
        net.parameters(),
        lr=float(params.get("lr", 1e-2)),
        weight_decay=float(params.get("weight_decay", 0.0)),
    )
    mse = nn.MSELoss()
    loss_fn: Any = nn.CrossEntropyLoss() if classify else (lambda pred, target: mse(pred.squeeze(1), target))
    batch = int(params.get("batch_size", 64))
    gen = torch.Generator().manual_seed(ctx.seed)
    for epoch in range(int(params.get("epochs", 20))):
        net.train()
        total = 0.0
        for idx in torch.randperm(len(X), generator=gen).split(batch):
            loss = batch_loss(net, loss_fn, X[idx], y[idx])
            loss.backward()
            apply_update(opt)
            total += loss.item() * len(idx)
        if ctx.log is not None:
            ctx.log(epoch, {"train/loss": total / len(X)})
        if len(data.X_val):
            ctx.report(epoch, ctx.score(net, data.X_val, data.y_val))
    net.eval()
    return net


def _estimator_class(path: str) -> Any:
    module_name, _, cls = path.rpartition(".")
    if not module_name.startswith("sklearn."):
        raise ConfigError(
            f"estimator {path!r} must be a scikit-learn class such as sklearn.tree.DecisionTreeClassifier"
        )
    return import_ref(f"{module_name}:{cls}", "estimator")


def train_sklearn(params: dict[str, Any], data: Splits, ctx: TrainContext) -> Any:
    """Fit the scikit-learn estimator named by ``params['estimator']`` with the other params.

    Raises:
        ConfigError: no estimator, not a scikit-learn class, or a parameter it does not take.
    """
    if "estimator" not in params:
        raise ConfigError("train_sklearn needs params.estimator, e.g. sklearn.tree.DecisionTreeClassifier")
    cls = _estimator_class(str(params["estimator"]))
    kwargs = {k: v for k, v in params.items() if k != "estimator"}
    valid = cls().get_params()
    if "random_state" in valid and "random_state" not in kwargs:
        kwargs["random_state"] = ctx.seed
    unknown = sorted(set(kwargs) - set(valid))
    if unknown:
        raise ConfigError(f"{params['estimator']} has no parameter(s) {', '.join(unknown)}")
    model = cls(**kwargs).fit(data.X_train, data.y_train)
    if len(data.X_val):
        ctx.report(0, ctx.score(model, data.X_val, data.y_val))
    return model
