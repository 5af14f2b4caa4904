"""The tree of a state dict as an in-memory snapshot stores it: tensors laid out back to back in one
data file, everything else kept in the snapshot's description; and the way back into a live state."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import torch

Entry = tuple[int, int, str, list[int]]  # (offset, bytes, dtype, shape) of one tensor in a data file


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    # A DTensor's shard on this rank; a plain tensor itself.
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def fill(live: Any, snap: Any, where: str = "") -> Any:
    """Copy a snapshot tree into a live state tree: tensors in place (a DTensor's local shard),
    other values taken from the snapshot. Returns the filled tree (for ``set_state_dict``).

    Raises:
        ValueError: when the trees differ in keys or tensor shapes (another model or layout).
    """
    if isinstance(live, dict):
        if not isinstance(snap, dict) or live.keys() != snap.keys():
            raise ValueError(f"snapshot does not match the state at {where or '/'}")
        return {k: fill(live[k], snap[k], f"{where}/{k}") for k in live}
    if isinstance(live, (list, tuple)):
        if not isinstance(snap, (list, tuple)) or len(live) != len(snap):
            raise ValueError(f"snapshot does not match the state at {where}")
        return type(live)(fill(a, b, f"{where}/{i}") for i, (a, b) in enumerate(zip(live, snap, strict=True)))
    if isinstance(live, torch.Tensor):
        target = local_tensor(live)
        if not isinstance(snap, torch.Tensor) or target.shape != snap.shape:
            raise ValueError(f"snapshot tensor {where} does not match the state's shape")
        target.copy_(snap)
        return live
    return snap


ALIGN = 64


ATOMS = (int, float, bool, str, bytes, type(None), torch.dtype)


def copy_value(value: Any) -> Any:
    """A copy of a small value as ``copy.deepcopy`` makes it, faster for what a snapshot holds
    (random states: tuples of hundreds of ints; scalars): immutable atoms are shared, containers
    rebuilt, tensors cloned, anything else deep-copied."""
    kind = type(value)
    if kind in ATOMS:
        return value
    if kind is tuple or kind is list:
        if all(type(v) in ATOMS for v in value):
            return value if kind is tuple else list(value)
        return kind(copy_value(v) for v in value)
    if kind is dict:
        return {k: copy_value(v) for k, v in value.items()}
    if isinstance(value, torch.Tensor) and type(value) is torch.Tensor:
        return value.detach().clone()
    return copy.deepcopy(value)


def flatten(tree: Any, out: list[torch.Tensor]) -> Any:
    """The tree with each tensor replaced by ``{"__t": i}`` (``out[i]`` is the tensor) and every
    other value copied."""
    if isinstance(tree, dict):
        return {k: flatten(v, out) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(flatten(v, out) for v in tree)
    if not isinstance(tree, torch.Tensor):
        return copy_value(tree)
    out.append(tree)
    return {"__t": len(out) - 1}


def plain(t: torch.Tensor) -> torch.Tensor:
    # The local data of a state-dict tensor, out of autograd (state dicts are detached already).
    t = local_tensor(t)
    return t.detach() if t.requires_grad else t


def plan_layout(tensors: Sequence[torch.Tensor]) -> list[Entry]:
    """(offset, bytes, dtype, shape) of each (local) tensor's data in the data file, packed in
    order and 64-byte aligned."""
    out: list[Entry] = []
    offset = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        out.append((offset, nbytes, str(t.dtype).removeprefix("torch."), list(t.shape)))
        offset = -(-(offset + nbytes) // ALIGN) * ALIGN
    return out


def host_tree(tree: Any, tensors: Sequence[torch.Tensor], views: Sequence[torch.Tensor]) -> Any:
    """The flattened tree with each tensor replaced by its view in the data file (a DTensor keeps
    its sharding, so a persisted checkpoint has the same DCP layout as a direct save)."""
    if isinstance(tree, dict):
        if tree.keys() == {"__t"}:
            from torch.distributed.tensor import DTensor

            i = tree["__t"]
            t, dst = tensors[i], views[i]
            if not isinstance(t, DTensor):
                return dst
            return DTensor.from_local(
                dst, t.device_mesh, t.placements, run_check=False, shape=t.shape, stride=t.stride()
            )
        return {k: host_tree(v, tensors, views) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(host_tree(v, tensors, views) for v in tree)
    return tree


def total_bytes(layout: list[Entry]) -> int:
    return max(1, layout[-1][0] + layout[-1][1]) if layout else 1


def view_of(store: torch.Tensor, entry: Entry) -> torch.Tensor:
    offset, nbytes, dtype, shape = entry
    return store[offset : offset + nbytes].view(getattr(torch, dtype)).view(shape)


def rebuild(tree: Any, views: list[torch.Tensor]) -> Any:
    if isinstance(tree, dict):
        if tree.keys() == {"__t"}:
            return views[tree["__t"]]
        return {k: rebuild(v, views) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(rebuild(v, views) for v in tree)
    return tree


def read_snapshot(meta: dict[str, Any], data: torch.Tensor) -> dict[str, Any]:
    """The trees of a snapshot from its description and its data bytes (tensors are views of them)."""
    views = [view_of(data, entry) for entry in meta["layout"]]
    return {
        "step": meta["step"],
        "world_size": meta["world_size"],
        "app": rebuild(meta["tree"], views),
        "rank_state": meta["rank_state"],
    }
