"""Metrics come from scikit-learn with the right averaging; splits stay apart; bad input is refused."""

from __future__ import annotations

import numpy as np
import pytest
from sklearn import metrics as skm
from sklearn.datasets import load_breast_cancer, load_diabetes, load_digits
from sklearn.linear_model import LinearRegression
from sklearn.naive_bayes import GaussianNB
from sklearn.svm import LinearSVC

from gpuyard.errors import ConfigError
from gpuyard.models.evaluate import evaluate
from gpuyard.models.metrics import check_direction, compute, get_metric, is_better

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def digits_model() -> tuple[GaussianNB, np.ndarray, np.ndarray]:
    # Naive Bayes: probabilities for ROC-AUC, and fitted in milliseconds even on a busy machine.
    X, y = load_digits(return_X_y=True)
    return GaussianNB().fit(X[:1200], y[:1200]), X[1200:], y[1200:]


def test_multiclass_metrics_match_sklearn_averages(digits_model) -> None:
    model, X, y = digits_model
    ev = evaluate(model, X, y, "classification", "validation")
    pred = model.predict(X)
    assert ev.metrics["accuracy"] == pytest.approx(skm.accuracy_score(y, pred))
    assert ev.metrics["f1_macro"] == pytest.approx(skm.f1_score(y, pred, average="macro"))
    assert ev.metrics["f1_weighted"] == pytest.approx(skm.f1_score(y, pred, average="weighted"))
    assert ev.metrics["precision_macro"] == pytest.approx(skm.precision_score(y, pred, average="macro"))
    assert ev.metrics["recall_weighted"] == pytest.approx(skm.recall_score(y, pred, average="weighted"))
    proba = model.predict_proba(X)
    assert ev.metrics["roc_auc"] == pytest.approx(skm.roc_auc_score(y, proba, multi_class="ovr"))
    cm = np.asarray(ev.details["confusion_matrix"])
    assert cm.sum() == len(y) and np.trace(cm) == (pred == y).sum()
    assert ev.split == "validation" and ev.n_samples == len(y)


def test_binary_roc_auc_uses_positive_class() -> None:
    X, y = load_breast_cancer(return_X_y=True)
    model = GaussianNB().fit(X[:400], y[:400])
    ev = evaluate(model, X[400:], y[400:], "classification", "test", metrics=["roc_auc", "accuracy"])
    assert ev.metrics["roc_auc"] == pytest.approx(
        skm.roc_auc_score(y[400:], model.predict_proba(X[400:])[:, 1])
    )


def test_model_without_probabilities_gets_no_made_up_roc_auc() -> None:
    X, y = load_breast_cancer(return_X_y=True)
    model = LinearSVC(max_iter=200).fit(X[:400] / X.max(0), y[:400])
    ev = evaluate(model, X[400:] / X.max(0), y[400:], "classification", "test")
    assert "roc_auc" not in ev.metrics and "accuracy" in ev.metrics


def test_regression_metrics() -> None:
    X, y = load_diabetes(return_X_y=True)
    model = LinearRegression().fit(X[:300], y[:300])
    ev = evaluate(model, X[300:], y[300:], "regression", "test")
    pred = model.predict(X[300:])
    assert ev.metrics["mse"] == pytest.approx(skm.mean_squared_error(y[300:], pred))
    assert ev.metrics["mae"] == pytest.approx(skm.mean_absolute_error(y[300:], pred))
    assert ev.metrics["r2"] == pytest.approx(skm.r2_score(y[300:], pred))
    assert ev.details == {}


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: get_metric("acuracy"), "unknown metric 'acuracy'"),
        (lambda: get_metric("mse", "classification"), "is a regression metric"),
        (lambda: check_direction("up"), "unknown direction 'up'"),
        (lambda: check_direction("maximize", "mse"), "better when minimized"),
        (lambda: compute("roc_auc", [0, 1], [0, 1]), "needs class probabilities"),
    ],
)
def test_bad_metric_or_direction_is_refused(call, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        call()


def test_bad_split_and_empty_input(digits_model) -> None:
    model, X, y = digits_model
    with pytest.raises(ConfigError, match="unknown split"):
        evaluate(model, X, y, "classification", "dev")
    with pytest.raises(ConfigError, match="non-zero"):
        evaluate(model, X[:0], y[:0], "classification", "test")


def test_is_better_follows_direction() -> None:
    assert is_better(0.9, 0.8, "maximize") and not is_better(0.8, 0.8, "maximize")
    assert is_better(1.0, 2.0, "minimize") and not is_better(2.0, 1.0, "minimize")
