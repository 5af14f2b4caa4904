"""Model signatures: the input and output schema a registered model promises (serving checks it)."""

from __future__ import annotations

from typing import Any

import numpy as np

from gpuyard.errors import ConfigError


def infer_signature(
    X: np.ndarray, y_pred: np.ndarray, task: str, feature_names: tuple[str, ...] | list[str] = ()
) -> dict[str, Any]:
    """Describe inputs (dtype, shape with -1 for the batch, names, observed per-feature range) and outputs.

    Args:
        X: a sample of inputs (the training features).
        y_pred: the model's predictions on ``X`` (gives the output dtype and, for classes, the labels).
        task: classification or regression.
        feature_names: column names when known.
    """
    X = np.asarray(X)
    if X.ndim < 2 or len(X) == 0:
        raise ConfigError(f"a signature needs a non-empty batch of inputs, got shape {X.shape}")
    y_pred = np.asarray(y_pred)
    inputs: dict[str, Any] = {
        "dtype": "float32",
        "shape": [-1, *X.shape[1:]],
        "min": np.min(X, axis=0).reshape(-1).astype(float).tolist(),
        "max": np.max(X, axis=0).reshape(-1).astype(float).tolist(),
    }
    if feature_names:
        inputs["names"] = list(feature_names)
    outputs: dict[str, Any] = {"dtype": str(y_pred.dtype), "shape": [-1]}
    if task == "classification":
        outputs["classes"] = np.unique(y_pred).tolist()
    return {"task": task, "inputs": inputs, "outputs": outputs}


def check_input(signature: dict[str, Any], X: np.ndarray) -> None:
    """Check that ``X`` matches the signature's input shape (batch dimension free).

    Raises:
        ConfigError: wrong number of dimensions or a wrong feature size, naming both.
    """
    shape = signature.get("inputs", {}).get("shape")
    if not shape:
        return
    X = np.asarray(X)
    if X.ndim != len(shape) or any(want not in (-1, got) for want, got in zip(shape, X.shape, strict=True)):
        raise ConfigError(f"input shape {list(X.shape)} does not match the model's signature {shape}")


# -- the serving contract: raw records -> the training recipe -> the model's features -------------------

RECIPE_KEY = "recipe"
# Where a number is expected, these JSON values are refused (a boolean is not a number: true is not 1.0).
_NUMBER_KINDS = ("int", "float")


class RecordError(ConfigError):
    """A raw record the recipe cannot take (a missing or unknown column, a value of the wrong kind): 422."""


def serving_recipe(dataset_ref: str | None) -> dict[str, Any] | None:
    """The serving contract of the gpuyard dataset version ``dataset_ref`` (``NAME@VERSION[#split=...]``).

    It holds what turns a raw record (the columns of the version's ingested ancestor) into the
    model's feature vector exactly as the training data was made: the raw columns read (name, kind,
    Arrow type, tensor shape, the value ingest imputed for nulls), every transform between the
    ingested version and ``dataset_ref`` (its recipe and the statistics fitted on its train split, as
    the manifests store them), the feature columns in the order :func:`gpuyard.data.arrays.version_arrays`
    stacks them, and one name per flattened feature (``income``, ``city=paris``, ``image[3,4]``).

    Returns None for ``sklearn:``/``npz:`` references (no recipe: their features are the inputs) and for
    a version that cannot feed a model.

    Raises:
        NotFoundError: the version, or one of its ancestors, is not in the catalog.
    """
    if not dataset_ref or dataset_ref.startswith(("sklearn:", "npz:")):
        return None
    from gpuyard.data.arrays import BOOKKEEPING, feature_columns
    from gpuyard.data.dataset import open_dataset
    from gpuyard.data.recipe import Recipe
    from gpuyard.refs import DatasetRef

    leaf = open_dataset(str(DatasetRef.parse_base(dataset_ref)))
    label = leaf.label_column
    if not label:
        return None
    chain = [leaf]
    while chain[-1].manifest.get("kind") == "transform" and chain[-1].manifest.get("parent"):
        chain.append(open_dataset(str(chain[-1].manifest["parent"])))
    chain.reverse()
    root, transforms = chain[0], chain[1:]
    features = feature_columns(leaf, label)
    used = set(features)
    for v in transforms:
        used |= set(Recipe.model_validate(v.manifest.get("recipe") or {}).input_columns())
    imputed = ((root.manifest.get("recipe") or {}).get("imputed")) or {}
    columns, ignored = [], []
    for c in root.manifest["schema"]:
        name = str(c["name"])
        if name == label or name in BOOKKEEPING or name not in used:
            ignored.append(name)
            continue
        entry = {k: c[k] for k in ("name", "kind", "type", "tensor") if k in c}
        if name in imputed:
            entry["impute"] = imputed[name].get("value")
        columns.append(entry)
    schema = {str(c["name"]): c for c in leaf.manifest["schema"]}
    encoded: dict[str, Any] = {}  # the categories of every one-hot step of the chain, the last one winning
    for v in transforms:
        encoded.update((v.manifest.get("fitted") or {}).get("encode") or {})
    return {
        "dataset": leaf.ref,
        "source": root.ref,
        "label": label,
        "columns": columns,
        "ignored": ignored,
        "transforms": [
            {
                "dataset": v.ref,
                "kind": "transform",
                "recipe": v.manifest.get("recipe") or {},
                "fitted": v.manifest.get("fitted") or {},
            }
            for v in transforms
        ],
        "features": [
            {k: schema[f][k] for k in ("name", "kind", "type", "tensor") if k in schema[f]} for f in features
        ],
        "names": _flat_names([schema[f] for f in features], encoded),
        # The rows the model learnt from: the training distribution raw inputs are checked against.
        "splits": list(DatasetRef.parse(dataset_ref).splits or ()),
    }


def _flat_names(features: list[dict[str, Any]], encoded: dict[str, Any]) -> list[str]:
    """One name per flattened feature: ``col``, ``col=category`` (one-hot), ``col[i]``/``col[i,j]``."""
    names: list[str] = []
    for f in features:
        name = str(f["name"])
        if "tensor" not in f:
            names.append(name)
            continue
        shape = tuple(int(d) for d in f["tensor"]["shape"])
        enc = encoded.get(name) or {}
        if enc.get("method") == "onehot" and shape == (len(enc.get("categories") or ()),):
            names.extend(f"{name}={cat}" for cat in enc["categories"])
        elif len(shape) == 1:
            names.extend(f"{name}[{i}]" for i in range(shape[0]))
        else:
            names.extend(f"{name}[{','.join(map(str, idx))}]" for idx in np.ndindex(*shape))
    return names


def attach_recipe(signature: dict[str, Any], dataset_ref: str | None) -> dict[str, Any]:
    """``signature`` with the serving contract of ``dataset_ref`` and its flattened feature names.

    The contract is attached only when its features are the model's inputs (as many values as the
    signature's input shape); otherwise, or for a dataset with no recipe to carry, ``signature`` comes
    back unchanged.
    """
    if not signature or RECIPE_KEY in signature:
        return signature
    contract = serving_recipe(dataset_ref)
    inputs = dict(signature.get("inputs") or {})
    shape = inputs.get("shape") or []
    if contract is None or len(shape) < 2 or int(np.prod(shape[1:])) != len(contract["names"]):
        return signature
    inputs["names"] = contract["names"]
    return {**signature, "inputs": inputs, RECIPE_KEY: contract}


class ServingRecipe:
    """A signature's serving contract, ready to turn raw records into the model's float32 features.

    The records become an Arrow table with the ingested version's column types; each transform is
    applied by :class:`gpuyard.data.fitted.FittedTransform` (the statistics fitted at training time,
    the same functions the transform ran over the training shards); the feature columns are stacked
    by the function :func:`gpuyard.data.arrays.version_arrays` uses for training.
    """

    def __init__(self, contract: dict[str, Any]) -> None:
        from gpuyard.data.dataset import DatasetVersion
        from gpuyard.data.fitted import FittedTransform

        self.contract = contract
        self.columns: list[dict[str, Any]] = list(contract["columns"])
        self.known = {str(c["name"]) for c in self.columns} | set(contract.get("ignored") or ())
        self.transforms = [FittedTransform.from_manifest(t) for t in contract["transforms"]]
        self.features = [str(f["name"]) for f in contract["features"]]
        # The stacking function reads only the feature columns' tensor specs from the version.
        self._leaf = DatasetVersion("serving", "contract", {"schema": contract["features"]})
        self.names = tuple(str(n) for n in contract["names"])

    @classmethod
    def from_signature(cls, signature: dict[str, Any]) -> ServingRecipe | None:
        """The signature's contract, or None when it carries none."""
        contract = (signature or {}).get(RECIPE_KEY)
        return cls(contract) if contract else None

    def raw_columns(self) -> list[str]:
        """The columns a record must hold."""
        return [str(c["name"]) for c in self.columns]

    def training_columns(self, rows: int = 2000, seed: int = 0) -> dict[str, tuple[str, np.ndarray]]:
        """The raw columns of (a sample of) the rows the model was trained on, for the skew check.

        The rows are the ingested version's, selected by the training dataset's split column (the
        splits the training reference named; every row when it named none). Tensor columns are left
        out (their values are the features, which drift monitoring already watches).

        Returns:
            column -> (kind, values): float64 for numbers, objects (text, booleans, None) otherwise.

        Raises:
            NotFoundError: the dataset versions are no longer in the catalog.
        """
        import pyarrow as pa
        import pyarrow.compute as pc

        from gpuyard.data.dataset import open_dataset
        from gpuyard.data.features import numeric

        cols = [c for c in self.columns if c["kind"] != "tensor"]
        if not cols:
            return {}
        table = open_dataset(str(self.contract["source"])).to_arrow([str(c["name"]) for c in cols])
        splits = self.contract.get("splits") or []
        if splits:
            split = open_dataset(str(self.contract["dataset"])).to_arrow(["split"]).column("split")
            table = table.filter(pc.is_in(split, value_set=pa.array(splits, pa.string())))
        if table.num_rows > rows:
            keep = np.sort(np.random.default_rng(seed).choice(table.num_rows, rows, replace=False))
            table = table.take(pa.array(keep))
        out: dict[str, tuple[str, np.ndarray]] = {}
        for c in cols:
            name, kind = str(c["name"]), str(c["kind"])
            column = table.column(name)
            if kind in _NUMBER_KINDS:
                out[name] = ("numeric", numeric(column))
            else:
                out[name] = ("categorical", np.asarray(column.to_pylist(), dtype=object))
        return out

    def table(self, records: list[Any]) -> Any:
        """The records as an Arrow table of the raw columns, each value checked against its kind.

        Raises:
            RecordError: not an object, a missing or unknown column, a value of the wrong kind; the
            message names the record and the column.
        """
        import pyarrow as pa

        for i, rec in enumerate(records):
            if not isinstance(rec, dict):
                raise RecordError(f"record {i} is {_json_kind(rec)}, not an object keyed by column")
            unknown = [k for k in rec if k not in self.known]
            if unknown:
                reads = ", ".join(self.raw_columns())
                raise RecordError(f"record {i}: unknown column {unknown[0]!r} (the model reads {reads})")
        arrays, fields = [], []
        for col in self.columns:
            name = str(col["name"])
            values = []
            for i, rec in enumerate(records):
                if name not in rec:
                    raise RecordError(f"record {i}: column {name!r} is missing")
                values.append(_check_value(rec[name], col, i))
            arr, field = _column(values, col)
            arrays.append(arr)
            fields.append(field)
        return pa.Table.from_arrays(arrays, schema=pa.schema(fields))

    def features_of(self, records: list[Any]) -> np.ndarray:
        """The float32 feature matrix of ``records`` (see the class docstring)."""
        return self.transform(self.table(records))

    def transform(self, table: Any) -> np.ndarray:
        """The float32 feature matrix of a raw table from :meth:`table`."""
        from gpuyard.data.arrays import _matrix  # training's one way from feature columns to X

        for ft in self.transforms:
            table = ft.apply(table)
        return _matrix(self._leaf, table, self.features)


def _json_kind(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


def _check_value(value: Any, col: dict[str, Any], i: int) -> Any:
    """``value`` of record ``i`` for column ``col``, checked (None stays None where a null is allowed)."""
    name, kind = str(col["name"]), str(col["kind"])
    where = f"record {i}, column {name!r}"
    if value is None:
        if "impute" in col:
            return col["impute"]  # what ingest put in the training rows' nulls
        if kind == "string":
            return None  # an unknown category, as a null was at training time
        raise RecordError(f"{where}: null, but the model needs a {_want(col)}")
    if kind in _NUMBER_KINDS:
        if isinstance(value, bool):
            raise RecordError(f"{where}: a boolean where a number is expected (send 1 or 0, not true)")
        if not isinstance(value, (int, float)):
            raise RecordError(f"{where}: {_json_kind(value)} where a number is expected")
        if isinstance(value, float) and not np.isfinite(value):
            raise RecordError(f"{where}: value is NaN or infinite")
        if kind == "int":
            if isinstance(value, float):
                if not value.is_integer():
                    raise RecordError(f"{where}: {value!r} is not an integer")
                value = int(value)
            if not -(2**63) <= value < 2**63:
                raise RecordError(f"{where}: {value} does not fit a 64-bit integer")
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise RecordError(f"{where}: {_json_kind(value)} where true or false is expected")
        return value
    if kind == "string":
        if not isinstance(value, str):
            raise RecordError(f"{where}: {_json_kind(value)} where a string is expected")
        return value
    if kind == "tensor":
        return _check_tensor(value, col, where)
    raise RecordError(f"{where}: columns of kind {kind} cannot be sent in a JSON record")


def _check_tensor(value: Any, col: dict[str, Any], where: str) -> np.ndarray:
    spec = col["tensor"]
    shape, dtype = tuple(int(d) for d in spec["shape"]), np.dtype(spec["dtype"])
    try:
        raw = np.asarray(value)
    except (ValueError, RecursionError):
        raise RecordError(f"{where}: ragged nested lists; expected shape {list(shape)}") from None
    if raw.dtype.kind not in "iuf":
        got = "booleans" if raw.dtype.kind == "b" else "other values"
        raise RecordError(f"{where}: must hold only numbers (got {got})")
    if raw.shape != shape:
        raise RecordError(f"{where}: shape {list(raw.shape)}, expected {list(shape)}")
    with np.errstate(invalid="ignore"):
        if not np.isfinite(raw.astype(np.float64)).all():
            raise RecordError(f"{where}: values must be finite")
    if dtype.kind in "iu":
        info = np.iinfo(dtype)
        as_float = raw.astype(np.float64)
        if (as_float != np.round(as_float)).any() or as_float.min() < info.min or as_float.max() > info.max:
            raise RecordError(f"{where}: values must be integers in [{info.min}, {info.max}] ({dtype})")
    return raw.astype(dtype)


def _want(col: dict[str, Any]) -> str:
    kind = str(col["kind"])
    return {"int": "integer", "float": "number", "bool": "true or false"}.get(kind, kind)


def _column(values: list[Any], col: dict[str, Any]) -> tuple[Any, Any]:
    """An Arrow array and field for one raw column (the type the ingested version stored)."""
    import pyarrow as pa

    from gpuyard.data.columns import tensor_array, tensor_field

    name, kind = str(col["name"]), str(col["kind"])
    if kind == "tensor":
        arr, spec = tensor_array(np.stack(values))
        return arr, tensor_field(name, spec)
    default = {"int": pa.int64(), "float": pa.float64(), "bool": pa.bool_(), "string": pa.string()}[kind]
    try:
        typ = pa.type_for_alias(str(col.get("type")))
    except ValueError:
        typ = default  # a dictionary-encoded text column, for one: plain text reads the same
    if kind in _NUMBER_KINDS and not (pa.types.is_integer(typ) or pa.types.is_floating(typ)):
        typ = default
    try:
        arr = pa.array(values, type=typ)
    except (pa.ArrowInvalid, OverflowError) as exc:
        raise RecordError(f"column {name!r}: a value does not fit {typ}: {str(exc)[:120]}") from None
    return arr, pa.field(name, typ)
