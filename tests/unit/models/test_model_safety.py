"""A model file is data, never code: crafted skops, safetensors, ONNX and torch configs are refused
before anything in them runs; every kind of model gpuyard builds still round-trips."""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sklearn.datasets import load_iris

from gpuyard.errors import ConfigError
from gpuyard.models.flavors import load_model, load_skops, save_model
from gpuyard.models.safety import (
    UnsafeModelError,
    check_model_safety,
    check_onnx,
    check_safetensors,
    check_skops,
)

pytestmark = pytest.mark.unit


def _json(value: Any) -> dict[str, Any]:
    return {
        "__class__": "str",
        "__module__": "builtins",
        "__loader__": "JsonNode",
        "content": json.dumps(value),
    }


def _tuple(*items: dict[str, Any]) -> dict[str, Any]:
    return {"__class__": "tuple", "__module__": "builtins", "__loader__": "TupleNode", "content": list(items)}


def payloads(marker: Path) -> dict[str, dict[str, Any]]:
    """Nodes that would run code (write ``marker``) if skops built them: one per calling node kind."""
    code = f"open({str(marker)!r}, 'w').write('ran')"
    shell = f"touch {marker}"
    return {
        # builtins.eval(code): the attack of issue 26 (it passed the old 'builtins.' prefix)
        "reduce-eval": {
            "__class__": "eval",
            "__module__": "builtins",
            "__loader__": "ConstructorFromReduceNode",
            "content": _tuple(_json(code)),
        },
        "loss-os-system": {
            "__class__": "system",
            "__module__": "os",
            "__loader__": "LossNode",
            "__reduce__": {"args": _tuple(_json(shell))},
            "content": {
                "__class__": "dict",
                "__module__": "builtins",
                "__loader__": "DictNode",
                "content": {},
            },
        },
        "tree-posing-eval": {  # a TreeNode whose type is not Tree
            "__class__": "exec",
            "__module__": "builtins",
            "__loader__": "TreeNode",
            "__reduce__": {"args": _tuple(_json(code))},
            "content": {
                "__class__": "dict",
                "__module__": "builtins",
                "__loader__": "DictNode",
                "content": {},
            },
        },
        "function-numpy-load": {"__class__": "load", "__module__": "numpy", "__loader__": "FunctionNode"},
        "function-eval": {"__class__": "eval", "__module__": "builtins", "__loader__": "FunctionNode"},
        "scipy-function": {"__class__": "loadmat", "__module__": "scipy.io", "__loader__": "FunctionNode"},
        "type-import": {"__class__": "system", "__module__": "os", "__loader__": "TypeNode"},
        "object-subprocess": {
            "__class__": "Popen",
            "__module__": "subprocess",
            "__loader__": "ObjectNode",
            "content": {
                "__class__": "dict",
                "__module__": "builtins",
                "__loader__": "DictNode",
                "content": {},
            },
        },
        "method": {
            "__class__": "LogisticRegression",
            "__module__": "sklearn.linear_model._logistic",
            "__loader__": "MethodNode",
            "content": {
                "func": "fit",
                "obj": {
                    "__class__": "LogisticRegression",
                    "__module__": "sklearn.linear_model._logistic",
                    "__loader__": "ObjectNode",
                },
            },
        },
        "operator-methodcaller": {
            "__class__": "methodcaller",
            "__module__": "operator",
            "__loader__": "OperatorFuncNode",
            "attrs": _tuple(_json("system"), _json(shell)),
        },
        "namedtuple-posing": {
            "__class__": "Popen",
            "__module__": "subprocess",
            "__loader__": "TupleNode",
            "content": [_json(shell)],
        },
        "unknown-kind": {"__class__": "x", "__module__": "x", "__loader__": "QuantileForestNode"},
    }


def _fitted_tree(depth: int = 3) -> Any:
    from sklearn.tree import DecisionTreeClassifier

    X, y = load_iris(return_X_y=True)
    return DecisionTreeClassifier(max_depth=depth, random_state=0).fit(X, y)


def _rewrite(src: Path, dst: Path, edit: Any) -> Path:
    """Copy the skops zip ``src`` to ``dst`` with its schema.json passed through ``edit``."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for item in zin.infolist():
            data = zin.read(item)
            if item.filename == "schema.json":
                schema = json.loads(data)
                edit(schema)
                data = json.dumps(schema).encode()
            zout.writestr(item, data)
    return dst


def evil_skops(folder: Path, marker: Path, kind: str = "reduce-eval") -> Path:
    """A real fitted tree with one extra attribute whose node would run code when loaded."""
    import skops.io as sio

    clean = folder / "clean.skops"
    sio.dump(_fitted_tree(), clean)
    node = payloads(marker)[kind]

    def add(schema: dict[str, Any]) -> None:
        attrs = schema["content"]
        attrs["content"]["evil"] = node
        str_type = {"__class__": "str", "__module__": "builtins", "__loader__": "TypeNode"}
        attrs["key_types"]["content"].append(str_type)  # skops pairs keys with their types

    return _rewrite(clean, folder / "model.skops", add)


@pytest.mark.parametrize("kind", sorted(payloads(Path("/m"))))
def test_a_skops_node_that_would_run_code_is_refused_naming_its_type(kind: str, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    path = evil_skops(tmp_path, marker, kind)
    node = payloads(marker)[kind]
    with pytest.raises(UnsafeModelError) as err:
        load_skops(path)
    message = str(err.value)
    assert "\n" not in message and f"{node['__module__']}.{node['__class__']}" in message, message
    assert isinstance(err.value, ConfigError)  # exit 2 / HTTP 422
    assert not marker.exists()


def test_the_eval_payload_is_live_code_for_skops_itself(tmp_path: Path) -> None:
    """The crafted file is a real attack: skops, trusting what the old prefix list trusted, runs it."""
    import skops.io as sio

    marker = tmp_path / "marker"
    path = evil_skops(tmp_path, marker)
    sio.load(path, trusted=sio.get_untrusted_types(file=path))
    assert marker.read_text() == "ran"


def test_load_model_refuses_it_before_skops_sees_it(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    folder = tmp_path / "m"
    save_model(_fitted_tree(), folder, "classification")
    evil_skops(tmp_path, marker).replace(folder / "model.skops")
    with pytest.raises(UnsafeModelError, match=r"builtins\.eval"):
        load_model(folder)
    assert not marker.exists()


def _edit_tree(tmp_path: Path, change: Any) -> Path:
    """A fitted tree's skops file with its node array changed by ``change(nodes)``."""
    import skops.io as sio

    clean = tmp_path / "clean.skops"
    sio.dump(_fitted_tree(), clean)
    out = tmp_path / "tree.skops"
    with zipfile.ZipFile(clean) as zin:
        schema = json.loads(zin.read("schema.json"))
        name = schema["content"]["content"]["tree_"]["content"]["content"]["nodes"]["file"]
        with zipfile.ZipFile(out, "w") as zout:
            for item in zin.infolist():
                data = zin.read(item)
                if item.filename == name:
                    import io

                    nodes = np.load(io.BytesIO(data), allow_pickle=False)
                    change(nodes)
                    buf = io.BytesIO()
                    np.save(buf, nodes, allow_pickle=False)
                    data = buf.getvalue()
                zout.writestr(item, data)
    return out


@pytest.mark.parametrize(
    "change, says",
    [
        (lambda n: n["left_child"].__setitem__(0, 10**9), "child indices"),
        (lambda n: n["right_child"].__setitem__(0, 0), "child indices"),  # a loop back to the root
        (lambda n: n["feature"].__setitem__(0, 4), "feature outside"),  # iris has 4 features
        (lambda n: n["right_child"].__setitem__(0, -1), "half-leaf"),
    ],
)
def test_a_tree_whose_indices_leave_its_arrays_is_refused(change: Any, says: str, tmp_path: Path) -> None:
    with pytest.raises(UnsafeModelError, match=says):
        check_skops(_edit_tree(tmp_path, change))


def test_a_tree_claiming_more_features_than_its_estimator_is_refused(tmp_path: Path) -> None:
    import skops.io as sio

    sio.dump(_fitted_tree(), tmp_path / "clean.skops")

    def edit(schema: dict[str, Any]) -> None:
        schema["content"]["content"]["n_features_in_"] = _json(2)

    with pytest.raises(UnsafeModelError, match="a tree for 4 features in an estimator of 2"):
        check_skops(_rewrite(tmp_path / "clean.skops", tmp_path / "t.skops", edit))


def _estimators() -> dict[str, Any]:
    from sklearn.compose import ColumnTransformer
    from sklearn.decomposition import PCA
    from sklearn.ensemble import (
        GradientBoostingClassifier,
        HistGradientBoostingRegressor,
        RandomForestClassifier,
    )
    from sklearn.feature_selection import SelectKBest
    from sklearn.linear_model import LogisticRegression, Ridge, SGDClassifier
    from sklearn.neighbors import KNeighborsClassifier
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import OneHotEncoder, StandardScaler
    from sklearn.svm import SVC

    return {
        "forest": RandomForestClassifier(n_estimators=3, max_depth=3, random_state=0),
        "gboost": GradientBoostingClassifier(n_estimators=3, max_depth=2, random_state=0),
        "hist-gboost": HistGradientBoostingRegressor(max_iter=3, random_state=0),
        "logistic": LogisticRegression(max_iter=200),
        "ridge": Ridge(),
        "sgd": SGDClassifier(random_state=0),
        "knn": KNeighborsClassifier(3),
        "mlp": MLPClassifier(hidden_layer_sizes=(4,), max_iter=20, random_state=0),
        "svc": SVC(probability=True, random_state=0),
        "pipeline": make_pipeline(StandardScaler(), PCA(2), SelectKBest(k=1), LogisticRegression()),
        "columns": make_pipeline(
            ColumnTransformer(
                [("bins", OneHotEncoder(handle_unknown="ignore"), [0]), ("rest", "passthrough", [1, 2, 3])]
            ),
            LogisticRegression(max_iter=200),
        ),
    }


def test_each_estimator_gpuyard_builds_round_trips(tmp_path: Path) -> None:
    """The allow-list is not too strict: gpuyard's train function fits scikit-learn estimators by name,
    and each saved one loads and predicts the same (trees, ensembles, linear, neighbours, pipelines)."""
    import warnings

    X, y = load_iris(return_X_y=True)
    X = np.round(X, 0)  # OneHotEncoder sees few categories
    for name, est in _estimators().items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            est.fit(X, y)
        folder = tmp_path / name
        save_model(est, folder, "regression" if name == "hist-gboost" else "classification")
        _, predictor = load_model(folder)
        np.testing.assert_array_equal(predictor.predict(X), est.predict(X), err_msg=name)


def test_train_sklearn_and_the_torch_factories_round_trip(tmp_path: Path) -> None:
    """What gpuyard's train function and its torch factories build loads back and predicts the same."""
    import torch

    from gpuyard.models.builtin import TrainContext, mlp, train_sklearn
    from gpuyard.models.datasets import Splits
    from gpuyard.models.flavors import TorchPredictor
    from gpuyard.serve.examples import tiny_mlp

    X, y = load_iris(return_X_y=True)
    data = Splits(X, y, X[:0], y[:0], X[:10], y[:10])
    ctx = TrainContext(task="classification", metric="accuracy")
    for i, est in enumerate(["sklearn.tree.DecisionTreeClassifier", "sklearn.ensemble.ExtraTreesClassifier"]):
        params = {"estimator": est, "max_depth": 3} | ({"n_estimators": 5} if "Trees" in est else {})
        model = train_sklearn(params, data, ctx)
        save_model(model, tmp_path / str(i), "classification")
        np.testing.assert_array_equal(load_model(tmp_path / str(i))[1].predict(X), model.predict(X))
    torch.manual_seed(0)
    tiny_kwargs = {"in_features": 4, "hidden": 8, "classes": 3}
    nets = {
        "mlp": (mlp(4, 3, hidden=8), None, None),
        "tiny": (tiny_mlp(**tiny_kwargs), "gpuyard.serve.examples:tiny_mlp", tiny_kwargs),
    }
    for name, (net, factory, kwargs) in nets.items():
        save_model(net, tmp_path / name, "classification", factory=factory, factory_kwargs=kwargs)
        loaded = load_model(tmp_path / name)[1].predict_proba(X)
        expected = TorchPredictor(net, "classification").predict_proba(X)
        np.testing.assert_allclose(loaded, expected, rtol=1e-5, atol=1e-6)  # type: ignore[arg-type]


def test_a_torch_config_naming_any_other_factory_is_refused(tmp_path: Path) -> None:
    """config.json is the member's: a factory 'os:system' would be called with its kwargs."""
    from gpuyard.models.builtin import mlp

    marker = tmp_path / "marker"
    save_model(mlp(4, 3, hidden=4), tmp_path, "classification")
    config = json.loads((tmp_path / "config.json").read_text())
    config |= {"factory": "os:system", "kwargs": {"command": f"touch {marker}"}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsafeModelError, match="torch factory 'os:system'"):
        load_model(tmp_path)
    assert not marker.exists()


def _safetensors(header: dict[str, Any], data: bytes, declared: int | None = None) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw) if declared is None else declared) + raw + data


@pytest.mark.parametrize(
    "blob, says",
    [
        (
            _safetensors({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8, 10**6),
            "header of",
        ),
        (
            _safetensors({"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}, b"\0" * 8),
            "refused",
        ),
        (
            _safetensors(
                {
                    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
                },
                b"\0" * 12,
            ),
            "refused",
        ),
        (_safetensors({"w": {"dtype": "EVIL", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8), "refused"),
        (_safetensors({"w": {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, b"\0" * 8), "refused"),
    ],
    ids=["header-larger-than-file", "offsets-past-the-end", "overlapping", "unknown-dtype", "shape-vs-bytes"],
)
def test_a_safetensors_file_with_a_lying_header_is_refused(blob: bytes, says: str, tmp_path: Path) -> None:
    path = tmp_path / "model.safetensors"
    path.write_bytes(blob)
    with pytest.raises(UnsafeModelError, match=says):
        check_safetensors(path)


def _onnx_with_external(folder: Path, location: str) -> Path:
    import onnx
    from onnx import TensorProto, helper

    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 3], np.zeros(12, np.float32).tobytes(), raw=True)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 3])],
        [w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    tensor = model.graph.initializer[0]
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", "48")):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    path = folder / "model.onnx"
    onnx.save(model, str(path))
    return path


@pytest.mark.parametrize("location", ["/etc/passwd", "../../secret.bin", "weights.bin"])
def test_onnx_with_external_data_is_refused(location: str, tmp_path: Path) -> None:
    path = _onnx_with_external(tmp_path, location)
    with pytest.raises(UnsafeModelError, match=f"external file '{location}'"):
        check_onnx(path)
    (tmp_path / "config.json").write_text(json.dumps({"flavor": "onnx", "task": "classification"}))
    with pytest.raises(UnsafeModelError):
        load_model(tmp_path)


def test_check_model_safety_passes_clean_files_of_every_flavor(tmp_path: Path) -> None:
    from gpuyard.models.builtin import mlp

    save_model(mlp(4, 3, hidden=4), tmp_path / "t", "classification")
    config = json.loads((tmp_path / "t" / "config.json").read_text())
    assert check_model_safety(tmp_path / "t" / "model.safetensors", "torch", config) == []
    save_model(_fitted_tree(), tmp_path / "s", "classification")
    used = check_model_safety(tmp_path / "s" / "model.skops", "sklearn")
    assert "sklearn.tree._classes.DecisionTreeClassifier" in used and "sklearn.tree._tree.Tree" in used
