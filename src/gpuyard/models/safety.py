"""A model file is data, never code: what gpuyard checks in a model file before anything loads it.

Every model file comes from a member and is hostile until checked. :func:`check_model_safety` runs at
``gpuyard models register`` (before anything is stored) and again inside
:func:`gpuyard.models.flavors.load_model`, the one function every load goes through (serve, deploy,
promote, optimize, retrain, pipeline stages, ``load_run_model``).

- **skops** (``model.skops``): the zip's ``schema.json`` is read here, node by node, before skops
  sees it. Each node kind (skops' ``__loader__``) may only name the exact types listed for it
  (:data:`ALLOWED`); nothing is trusted by prefix. The kinds that call something when loaded are
  held to the tightest lists: objects (``ObjectNode``: ``cls.__new__`` + ``__setstate__``) only
  scikit-learn estimators (``sklearn.utils.all_estimators``, each by its exact ``module.qualname``)
  and the few internal classes fitted estimators hold; reduce nodes (``TreeNode``, ``LossNode``:
  ``constructor(*args)``) only ``sklearn.tree._tree.Tree`` and scikit-learn's loss classes;
  functions only the handful fitted estimators keep as defaults (``f_classif``, ``numpy.mean``);
  types only builtins and NumPy scalar types; methods, ``functools.partial``, ``operator``
  callables, named tuples, ``ConstructorFromReduceNode`` and unknown kinds never. Decision-tree
  arrays are bounds-checked (children, features) since scikit-learn indexes them unchecked. Only
  then does ``skops.io.load`` run, trusting exactly the names found (all on the list).
- **torch** (``model.safetensors`` + ``config.json``): the header is parsed by the ``safetensors``
  library (offsets inside the file, no overlaps or holes, known dtypes) after a size check; the
  architecture comes from a factory, and only gpuyard's own factories (:data:`TRUSTED_FACTORIES`)
  may be named: a factory is code, and ``config.json`` is the member's.
- **ONNX** (``model.onnx``): no tensor may keep its data outside the file (the registry stores one
  file; an external-data location would be read from wherever it points: ``/etc/passwd``, ``..``).

A refusal is :class:`UnsafeModelError` (a ConfigError: exit 2 from the CLI, HTTP 422 from the API),
one line naming the file and the type.
"""

from __future__ import annotations

import functools
import io
import json
import struct
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from gpuyard.errors import ConfigError

# The only torch factories a stored model may name (module:function): gpuyard's own builders.
TRUSTED_FACTORIES = frozenset(
    {
        "gpuyard.models.builtin:mlp",
        "gpuyard.serve.examples:tiny_mlp",
        "gpuyard.serve.examples:small_cnn",
        "gpuyard.serve.examples:small_transformer",
    }
)
MAX_SCHEMA_BYTES = 64 << 20  # schema.json of a 1,000-tree forest is ~10 MB
MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors library's own limit
MAX_NODES = 5_000_000
MAX_SKOPS_BYTES = 8 << 30  # every member's size once unpacked (a zip bomb is refused before reading)

# Node kinds that only hold data: each may name exactly these types.
_DATA_KINDS: dict[str, frozenset[str]] = {
    "DictNode": frozenset({"builtins.dict"}),
    "ListNode": frozenset({"builtins.list"}),
    "SetNode": frozenset({"builtins.set"}),
    "TupleNode": frozenset({"builtins.tuple"}),  # a named tuple would call its class: refused
    "SliceNode": frozenset({"builtins.slice"}),
    "BytesNode": frozenset({"builtins.bytes"}),
    "BytearrayNode": frozenset({"builtins.bytearray"}),
    "MaskedArrayNode": frozenset({"numpy.ma.core.MaskedArray"}),
    "DTypeNode": frozenset({"numpy.dtype"}),
    "RandomStateNode": frozenset({"numpy.random.mtrand.RandomState"}),
    "RandomGeneratorNode": frozenset({"numpy.random._generator.Generator"}),
}
# Functions fitted scikit-learn estimators keep as defaults (score_func, pooling_func, ...).
_FUNCTIONS = frozenset(
    {
        "numpy.mean",
        "numpy.median",
        "sklearn.feature_selection._univariate_selection.f_classif",
        "sklearn.feature_selection._univariate_selection.f_regression",
        "sklearn.feature_selection._univariate_selection.chi2",
        "sklearn.cluster._kmeans._kmeans_single_lloyd",
        "sklearn.cluster._kmeans._kmeans_single_elkan",
        "scipy._lib.array_api_compat.numpy._aliases.asarray",  # SplineTransformer's BSpline
    }
)
_BIT_GENERATORS = frozenset({"PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64"})
# Classes fitted estimators hold that are not estimators themselves (exact names).
_INTERNAL_CLASSES = frozenset(
    {
        "sklearn.calibration._CalibratedClassifier",
        "sklearn.calibration._SigmoidCalibration",
        "sklearn.cluster._bisect_k_means._BisectingTree",
        "sklearn.ensemble._hist_gradient_boosting.binning._BinMapper",
        "sklearn.ensemble._hist_gradient_boosting.predictor.TreePredictor",
        "sklearn.gaussian_process._gpc._BinaryGaussianProcessClassifierLaplace",
        "sklearn.neighbors._kd_tree.KDTree",
        "sklearn.neighbors._ball_tree.BallTree",
        "sklearn.neural_network._stochastic_optimizers.AdamOptimizer",
        "sklearn.neural_network._stochastic_optimizers.SGDOptimizer",
        "scipy.interpolate._bsplines.BSpline",
    }
)
_SPARSE = frozenset(
    f"scipy.sparse._{fmt}.{fmt}_{kind}"
    for fmt in ("csr", "csc", "coo", "bsr", "dia", "dok", "lil")
    for kind in ("matrix", "array")
)


class UnsafeModelError(ConfigError):
    """A model file asks for code or is malformed in a way that could make loading it unsafe."""


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


@functools.lru_cache(maxsize=1)
def allowed_types() -> dict[str, frozenset[str]]:
    """The exact type names each skops node kind may name (computed once: it walks scikit-learn)."""
    import warnings

    import sklearn._loss._loss as cyloss
    import sklearn._loss.link as link
    import sklearn._loss.loss as loss
    import sklearn.gaussian_process.kernels as kernels
    import sklearn.linear_model._sgd_fast as sgd
    import sklearn.metrics._dist_metrics as dist
    from sklearn.utils import all_estimators

    def classes(module: Any, base: type | tuple[type, ...]) -> set[str]:
        return {
            _name(c)
            for c in vars(module).values()
            if isinstance(c, type) and issubclass(c, base) and "PyFunc" not in c.__name__
        }

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        estimators = {_name(c) for _, c in all_estimators() if c.__module__.startswith("sklearn.")}
    objects = estimators | _INTERNAL_CLASSES
    objects |= classes(dist, (dist.DistanceMetric64, dist.DistanceMetric32))
    objects |= classes(kernels, kernels.Kernel) | classes(loss, loss.BaseLoss)
    objects |= classes(link, link.BaseLink) | {_name(link.Interval)}
    # Cython loss classes (skops' LossNode calls them with their saved arguments).
    losses = {_name(c) for n, c in vars(cyloss).items() if isinstance(c, type) and n.startswith("Cy")}
    losses |= classes(sgd, (sgd.Classification, sgd.Regression))
    losses -= {_name(cyloss.CyLossFunction), _name(sgd.Classification), _name(sgd.Regression)}
    scalars = {f"numpy.{t.__name__}" for t in set(np.sctypeDict.values())}
    primitives = {"builtins.str", "builtins.int", "builtins.float", "builtins.bool"}
    containers = {"builtins.list", "builtins.tuple", "builtins.dict", "builtins.set"}
    return {
        **_DATA_KINDS,
        "NdArrayNode": frozenset({"numpy.ndarray"} | scalars),
        "SparseMatrixNode": _SPARSE,
        "TypeNode": frozenset(primitives | containers | scalars),
        "FunctionNode": _FUNCTIONS,
        "ObjectNode": frozenset(objects),
        "TreeNode": frozenset({"sklearn.tree._tree.Tree"}),
        "LossNode": frozenset(losses),
    }


# The kinds that call what they name when loaded; said so in a refusal.
_CALLING = {
    "ObjectNode": "class",
    "TreeNode": "reduce constructor",
    "LossNode": "reduce constructor",
    "FunctionNode": "function",
    "TypeNode": "type",
    "NdArrayNode": "scalar type",
    "MethodNode": "method",
    "PartialNode": "functools.partial",
    "OperatorFuncNode": "operator callable",
    "ConstructorFromReduceNode": "reduce constructor",
    "DefaultDictNode": "defaultdict factory",
}


def check_skops(path: str | Path) -> list[str]:
    """Audit a skops file's ``schema.json``; return the type names it uses (all on the allow-list).

    Raises:
        UnsafeModelError: a node names a type, function or kind that is not allowed, or the file is
            malformed (no schema, wrong protocol, tree indices out of bounds).
    """
    from skops.io._protocol import PROTOCOL

    p = Path(path)
    try:
        with zipfile.ZipFile(p) as zf:
            unpacked = sum(i.file_size for i in zf.infolist())
            if unpacked > MAX_SKOPS_BYTES:
                raise UnsafeModelError(f"{p}: {unpacked} bytes once unpacked (limit {MAX_SKOPS_BYTES})")
            info = zf.getinfo("schema.json")
            if info.file_size > MAX_SCHEMA_BYTES:
                raise UnsafeModelError(
                    f"{p}: schema.json is {info.file_size} bytes (limit {MAX_SCHEMA_BYTES})"
                )
            schema = json.loads(zf.read(info))
            audit = _SkopsAudit(p, zf)
            audit.index(schema)
            if not isinstance(schema, dict) or schema.get("protocol") != PROTOCOL:
                found = schema.get("protocol") if isinstance(schema, dict) else None
                raise UnsafeModelError(
                    f"{p}: skops protocol {found!r}; gpuyard reads protocol {PROTOCOL} only (save it again)"
                )
            audit.node(schema, ())
    except (zipfile.BadZipFile, KeyError, ValueError, RecursionError, OSError) as exc:
        if isinstance(exc, UnsafeModelError):
            raise
        raise UnsafeModelError(f"{p}: not a readable skops file ({type(exc).__name__}: {exc})") from exc
    return sorted(audit.used)


class _SkopsAudit:
    """One pass over a schema: every node's kind and type checked, trees bounds-checked."""

    def __init__(self, path: Path, zf: zipfile.ZipFile) -> None:
        self.path, self.zf = path, zf
        self.allowed = allowed_types()
        self.used: set[str] = set()
        self.by_id: dict[Any, list[dict[str, Any]]] = {}
        self.json_cache: dict[int, Any] = {}
        self.count = 0

    def index(self, schema: Any) -> None:
        """Every node by its ``__id__``: skops loads the first node of an id wherever the id recurs."""
        stack = [schema]
        count = 0
        while stack:
            state = stack.pop()
            if not isinstance(state, dict):
                raise self.refuse("a skops node that is not an object")
            count += 1
            if count > MAX_NODES:
                raise self.refuse(f"more than {MAX_NODES} nodes")
            if state.get("__loader__") != "CachedNode" and "__id__" in state:
                self.by_id.setdefault(state["__id__"], []).append(state)
            stack.extend(_children(state))

    def refuse(self, what: str) -> UnsafeModelError:
        return UnsafeModelError(f"{self.path}: refused: {what} (a model file is data, never code)")

    def node(self, state: Any, n_features: tuple[int, ...]) -> None:
        """Check ``state`` (a node) and everything under it; ``n_features``: enclosing estimators'."""
        if not isinstance(state, dict) or not isinstance(state.get("__loader__"), str):
            raise self.refuse("a skops node without a __loader__")
        self.count += 1
        if self.count > MAX_NODES:
            raise self.refuse(f"more than {MAX_NODES} nodes")
        kind = state["__loader__"]
        module, cls = state.get("__module__"), state.get("__class__")
        if not isinstance(module, str) or not isinstance(cls, str):
            raise self.refuse(f"a {kind} without a type name")
        type_name = f"{module}.{cls}"
        if kind in ("JsonNode", "CachedNode"):  # JSON text, or a reference to a node already checked
            if kind == "CachedNode" and not self.by_id.get(state.get("__id__")):
                raise self.refuse("a cached node that refers to no earlier node")
            return
        allowed = self.allowed.get(kind)
        if allowed is None:
            what = _CALLING.get(kind, "node kind")
            raise self.refuse(f"{what} {type_name!r} ({kind} is never loaded)")
        if type_name not in allowed:
            raise self.refuse(f"{_CALLING.get(kind, kind)} {type_name!r} is not on gpuyard's allow-list")
        self.used.add(type_name)
        if kind == "RandomGeneratorNode":
            self._bit_generator(state)
        if kind == "NdArrayNode" and state.get("type") not in ("numpy", "json"):
            raise self.refuse(f"an array stored as {state.get('type')!r}")
        if kind == "ObjectNode":
            n_features = n_features + self._n_features_in(state)
        if kind == "TreeNode":
            self._tree(state, n_features)
        if type_name == "sklearn.ensemble._hist_gradient_boosting.predictor.TreePredictor":
            self._tree_predictor(state, n_features)
        for child in _children(state):
            self.node(child, n_features)

    def _bit_generator(self, state: dict[str, Any]) -> None:
        try:
            name = json.loads(state["content"]["bit_generator"]["content"]["bit_generator"]["content"])
        except (KeyError, TypeError, ValueError):
            name = None
        if name not in _BIT_GENERATORS:
            raise self.refuse(f"bit generator {name!r} is not one of {', '.join(sorted(_BIT_GENERATORS))}")

    def _resolve(self, state: Any) -> list[Any]:
        """The nodes skops may load for ``state``: every node of its id (it takes the first it meets)."""
        if isinstance(state, dict) and "__id__" in state:
            return self.by_id.get(state["__id__"], []) or (
                [] if state.get("__loader__") == "CachedNode" else [state]
            )
        return [state]

    def _json(self, state: Any) -> Any:
        """The JSON value of a JsonNode (None if it is not one, or if its id is ambiguous)."""
        return self._agreed(self._resolve(state))

    def _agreed(self, nodes: list[Any]) -> Any:
        """The one JSON value of already resolved ``nodes`` (None if any is not JSON or they differ)."""
        values = []
        for node in nodes:
            if not isinstance(node, dict) or node.get("__loader__") != "JsonNode":
                return None
            key = id(node)
            if key not in self.json_cache:
                self.json_cache[key] = json.loads(node["content"])
            values.append(self.json_cache[key])
        return values[0] if values and all(v == values[0] for v in values) else None

    def _field(self, state: dict[str, Any], key: str) -> list[Any]:
        """The nodes of attribute ``key`` in an object's state (a DictNode)."""
        out = []
        for content in self._resolve(state.get("content")):
            if isinstance(content, dict) and content.get("__loader__") == "DictNode":
                field = (content.get("content") or {}).get(key)
                out += self._resolve(field) if field is not None else []
        return out

    def _n_features_in(self, state: dict[str, Any]) -> tuple[int, ...]:
        value = self._agreed(self._field(state, "n_features_in_"))
        return (value,) if isinstance(value, int) and not isinstance(value, bool) else ()

    def _arrays(self, nodes: list[Any], what: str) -> list[np.ndarray]:
        if not nodes:
            raise self.refuse(f"{what} are missing")
        out = []
        for state in nodes:
            if not isinstance(state, dict) or state.get("__loader__") != "NdArrayNode" or "file" not in state:
                raise self.refuse(f"{what} are not a stored array")
            with self.zf.open(str(state["file"])) as fh:
                out.append(np.load(io.BytesIO(fh.read()), allow_pickle=False))
        return out

    def _tree(self, state: dict[str, Any], n_features: tuple[int, ...]) -> None:
        """scikit-learn walks ``Tree.nodes`` without bounds checks: children and features must be in range."""
        try:
            (args,) = self._resolve(state["__reduce__"]["args"])
            declared = self._json(args["content"][0])
        except (KeyError, TypeError, IndexError, ValueError):
            declared = None
        holder = n_features[-1] if n_features else None
        if not isinstance(declared, int) or declared != holder:
            raise self.refuse(f"a tree for {declared!r} features in an estimator of {holder!r}")
        counts = self._field(state, "node_count")
        for nodes in self._arrays(self._field(state, "nodes"), "a tree's nodes"):
            if self._agreed(counts) != len(nodes):
                raise self.refuse(f"a tree whose node_count is not its {len(nodes)} nodes")
            if not {"left_child", "right_child", "feature"} <= set(nodes.dtype.names or ()):
                raise self.refuse("a tree whose nodes lack left_child/right_child/feature")
            self._links(nodes["left_child"], nodes["right_child"], nodes["feature"], min(n_features), leaf=-1)

    def _tree_predictor(self, state: dict[str, Any], n_features: tuple[int, ...]) -> None:
        if not n_features:
            raise self.refuse("a tree predictor outside an estimator that records n_features_in_")
        for nodes in self._arrays(self._field(state, "nodes"), "a tree predictor's nodes"):
            if not {"left", "right", "feature_idx", "is_leaf", "is_categorical"} <= set(
                nodes.dtype.names or ()
            ):
                raise self.refuse("a tree predictor whose nodes lack left/right/feature_idx/is_leaf")
            if nodes["is_categorical"].any():
                raise self.refuse("a tree predictor with categorical splits (not supported)")
            leaf = nodes["is_leaf"].astype(bool)
            left = np.where(leaf, -1, nodes["left"].astype(np.int64))
            right = np.where(leaf, -1, nodes["right"].astype(np.int64))
            self._links(left, right, nodes["feature_idx"].astype(np.int64), min(n_features), leaf=-1)

    def _links(self, left: Any, right: Any, feature: Any, n_features: int, leaf: int) -> None:
        """Each inner node's children come after it and inside the array; its feature is a column."""
        n = len(left)
        idx = np.arange(n)
        is_leaf = (left == leaf) & (right == leaf)
        inner = ~is_leaf
        if n == 0 or ((left == leaf) != (right == leaf)).any():
            raise self.refuse("a tree with an empty node array or half-leaf nodes")
        for child in (left, right):
            if (inner & ((child <= idx) | (child >= n))).any():
                raise self.refuse(f"a tree whose child indices leave its {n} nodes (or point backwards)")
        if (inner & ((feature < 0) | (feature >= n_features))).any():
            raise self.refuse(f"a tree splitting on a feature outside 0..{n_features - 1}")


def _children(state: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every node under ``state``: each dict in its values that has a ``__loader__``, at any depth."""
    stack: list[Any] = [v for k, v in state.items() if not k.startswith("__") or k == "__reduce__"]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            if "__loader__" in value:
                yield value
            else:
                stack.extend(value.values())
        elif isinstance(value, list):
            stack.extend(value)


def check_safetensors(path: str | Path) -> None:
    """The header must be sane before any tensor is read: size, offsets, dtypes (the library checks).

    Raises:
        UnsafeModelError: a header larger than the file or the limit, or one the library rejects
            (offsets outside the file, overlapping or leaving holes, unknown dtypes).
    """
    p = Path(path)
    size = p.stat().st_size
    with p.open("rb") as fh:
        raw = fh.read(8)
    if len(raw) < 8:
        raise UnsafeModelError(f"{p}: a safetensors file needs an 8-byte header length")
    (n,) = struct.unpack("<Q", raw)
    if n > MAX_SAFETENSORS_HEADER or 8 + n > size:
        raise UnsafeModelError(f"{p}: safetensors header of {n} bytes in a file of {size} bytes")
    from safetensors import safe_open

    try:
        with safe_open(str(p), framework="numpy") as f:
            f.keys()
    except Exception as exc:  # SafetensorError (Rust) and friends: each means the header lies
        raise UnsafeModelError(f"{p}: safetensors header refused: {' '.join(str(exc).split())}") from exc


def check_onnx(path: str | Path) -> None:
    """No tensor may keep its data outside the model file (the registry stores only that file).

    Raises:
        UnsafeModelError: a tensor whose data lives in an external file (its location is named).
    """
    import onnx
    from onnx.external_data_helper import _get_all_tensors

    p = Path(path)
    try:
        model = onnx.load(str(p), load_external_data=False)
    except Exception as exc:  # protobuf's DecodeError
        raise UnsafeModelError(f"{p}: not a readable ONNX file ({type(exc).__name__})") from exc
    for tensor in _get_all_tensors(model):
        if tensor.data_location == onnx.TensorProto.EXTERNAL or tensor.external_data:
            where = {e.key: e.value for e in tensor.external_data}.get("location", "?")
            raise UnsafeModelError(
                f"{p}: refused: tensor {tensor.name!r} keeps its data in external file {where!r}; "
                "store the weights inside model.onnx"
            )


def check_factory(factory: Any) -> str:
    """A torch model's factory must be one of gpuyard's own (a factory is code; config.json is not ours).

    Raises:
        UnsafeModelError: any other ``module:function``.
    """
    if not isinstance(factory, str) or factory not in TRUSTED_FACTORIES:
        known = ", ".join(sorted(TRUSTED_FACTORIES))
        raise UnsafeModelError(f"refused: torch factory {factory!r} is not one of gpuyard's ({known})")
    return factory


def check_model_safety(path: str | Path, flavor: str, config: dict[str, Any] | None = None) -> list[str]:
    """Check one model file of ``flavor`` (and, for torch, its config's factory) before it is loaded.

    Returns the skops type names to trust (empty for the other flavors).

    Raises:
        UnsafeModelError: see :func:`check_skops`, :func:`check_safetensors`, :func:`check_onnx`,
            :func:`check_factory`.
    """
    if flavor == "sklearn":
        return check_skops(path)
    if flavor == "torch":
        check_safetensors(path)
        if config is not None:
            check_factory(config.get("factory"))
        return []
    if flavor == "onnx":
        check_onnx(path)
        return []
    if flavor in ("causal-lm", "lora-adapter"):  # gpuyard.models.llm: a folder of safetensors weights
        weights = sorted(Path(path).glob("*.safetensors"))
        if not weights:
            raise UnsafeModelError(f"{path}: a language model version without safetensors weights")
        for w in weights:
            check_safetensors(w)
        return []
    raise UnsafeModelError(f"{path}: model flavor {flavor!r} unknown")
