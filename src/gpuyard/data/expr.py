"""Safe column expressions for derived features (``bmi = weight / height ** 2``), evaluated with NumPy.

Only arithmetic, comparisons, column names, numbers and a few NumPy functions are allowed: a recipe is
data, and evaluating it must not run arbitrary code.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from gpuyard.errors import ConfigError

FUNCTIONS: dict[str, Callable[..., Any]] = {
    "abs": np.abs,
    "exp": np.exp,
    "log": np.log,
    "log1p": np.log1p,
    "sqrt": np.sqrt,
    "minimum": np.minimum,
    "maximum": np.maximum,
    "clip": np.clip,
    "where": np.where,
}
_BINOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: np.add,
    ast.Sub: np.subtract,
    ast.Mult: np.multiply,
    ast.Div: np.true_divide,
    ast.FloorDiv: np.floor_divide,
    ast.Mod: np.mod,
    ast.Pow: np.power,
}
_CMPOPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Lt: np.less,
    ast.LtE: np.less_equal,
    ast.Gt: np.greater,
    ast.GtE: np.greater_equal,
    ast.Eq: np.equal,
    ast.NotEq: np.not_equal,
}


def parse(expr: str) -> ast.expr:
    """Parse ``expr`` and check that it only uses allowed syntax.

    Raises:
        ConfigError: syntax error, or a construct outside arithmetic/comparison/allowed functions.
    """
    try:
        tree = ast.parse(expr, mode="eval").body
    except SyntaxError as exc:
        raise ConfigError(f"expression {expr!r}: {exc.msg}") from exc
    for node in ast.walk(tree):
        ok = isinstance(
            node,
            ast.BinOp
            | ast.UnaryOp
            | ast.Compare
            | ast.Name
            | ast.Constant
            | ast.Call
            | ast.Load
            | ast.operator,
        )
        ok = ok or isinstance(node, ast.unaryop | ast.cmpop)
        if not ok:
            raise ConfigError(f"expression {expr!r}: {type(node).__name__} is not allowed")
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id in FUNCTIONS):
            raise ConfigError(f"expression {expr!r}: only these functions: {', '.join(sorted(FUNCTIONS))}")
        if isinstance(node, ast.Constant) and not isinstance(node.value, int | float):
            raise ConfigError(f"expression {expr!r}: only numeric constants are allowed")
    return tree


def names(expr: str) -> set[str]:
    """Column names that ``expr`` reads."""
    tree = parse(expr)
    funcs = {n.func.id for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} - funcs


def evaluate(expr: str, columns: Mapping[str, np.ndarray]) -> np.ndarray:
    """Evaluate ``expr`` over the arrays in ``columns`` (elementwise)."""
    return np.asarray(_eval(parse(expr), columns))


def _eval(node: ast.expr, cols: Mapping[str, np.ndarray]) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name):
        if node.id not in cols:
            raise ConfigError(f"expression uses unknown column {node.id!r}")
        return cols[node.id]
    if isinstance(node, ast.UnaryOp):
        val = _eval(node.operand, cols)
        return np.negative(val) if isinstance(node.op, ast.USub) else val
    if isinstance(node, ast.BinOp):
        return _BINOPS[type(node.op)](_eval(node.left, cols), _eval(node.right, cols))
    if isinstance(node, ast.Compare):
        left, out = _eval(node.left, cols), None
        for op, comp in zip(node.ops, node.comparators, strict=True):
            right = _eval(comp, cols)
            res = _CMPOPS[type(op)](left, right)
            out = res if out is None else np.logical_and(out, res)
            left = right
        return out
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return FUNCTIONS[node.func.id](*[_eval(a, cols) for a in node.args])
    raise ConfigError(f"unsupported expression node {type(node).__name__}")
