"""Friendship prediction on a generated social graph with an edge-feature message-passing network.

People have an age and 8 interests; friendships carry a bond strength (an edge feature). Friends
tend to be close in age and to share interests. The network (plain PyTorch, no graph library):

    m_uv = MLP_msg([h_u, e_uv])                 one message per edge, from u to v, using the bond
    h_v' = ReLU(W_self h_v + mean_{u->v} m_uv)  gathered with index_add_ (irregular: by edge list)

twice, then a pair (u, v) is scored by an MLP over [h_u * h_v, |h_u - h_v|]. Held-out friendships
against random non-friend pairs measure it (ROC AUC, accuracy). The sharding stage cuts the graph
into parts the way a multi-GPU trainer would, and counts the edges that cross parts (each one a
feature fetch from another device per layer) for a hash partition and an age-range partition.

The stages are pipeline stages (``uses: friends:generate_stage`` etc.): the pipeline's folder is on
the import path of each stage's job.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import numpy as np

INTERESTS = 8


def make_graph(people: int, seed: int = 0, avg_friends: float = 8.0) -> dict[str, np.ndarray]:
    """People (age, interests) and friendships (src, dst, bond) with homophily on age and interests."""
    rng = np.random.default_rng(seed)
    age = rng.integers(16, 80, people).astype(np.float32)
    interests = (rng.random((people, INTERESTS)) < 0.3).astype(np.float32)
    # Candidate pairs, kept with a probability that falls with the age gap and rises with shared interests.
    cand = rng.integers(0, people, (people * int(avg_friends) * 6, 2))
    cand = cand[cand[:, 0] != cand[:, 1]]
    gap = np.abs(age[cand[:, 0]] - age[cand[:, 1]])
    shared = (interests[cand[:, 0]] * interests[cand[:, 1]]).sum(1)
    p = np.exp(-gap / 6.0) * (0.15 + 0.35 * shared)
    keep = rng.random(len(cand)) < np.clip(p, 0, 1)
    pairs = np.sort(cand[keep], axis=1)
    pairs = np.unique(pairs, axis=0)
    shared_k = (interests[pairs[:, 0]] * interests[pairs[:, 1]]).sum(1)
    bond = np.clip(0.2 + 0.15 * shared_k + rng.normal(0, 0.1, len(pairs)), 0.01, 1.0).astype(np.float32)
    return {"age": age, "interests": interests, "src": pairs[:, 0], "dst": pairs[:, 1], "bond": bond}


def generate_stage(inputs: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """Generate the graph and ingest it as two gpuyard datasets: ``people`` (nodes) and ``friendships``."""
    from gpuyard.data import IngestOptions, ValidationSpec, ingest

    g = make_graph(int(inputs.get("people", 2000)), int(inputs.get("seed", 0)))
    work = Path(ctx["workdir"])
    np.savez(work / "people.npz", person=np.arange(len(g["age"])), age=g["age"], interests=g["interests"])
    np.savez(work / "friendships.npz", src=g["src"], dst=g["dst"], bond=g["bond"])
    checks = ValidationSpec.model_validate({"columns": {"age": {"min": 0, "max": 120}}})
    people = ingest(work / "people.npz", "people", IngestOptions(checks=checks))
    edge_checks = ValidationSpec.model_validate({"columns": {"bond": {"min": 0, "max": 1}}})
    edges = ingest(work / "friendships.npz", "friendships", IngestOptions(checks=edge_checks))
    deg = np.bincount(np.concatenate([g["src"], g["dst"]]), minlength=len(g["age"]))
    return {
        "people": people.ref,
        "friendships": edges.ref,
        "report": [
            f"{people.ref}: {people.num_rows} people (age, {INTERESTS} interests);"
            f" {edges.ref}: {edges.num_rows} friendships with a bond strength",
            f"degree: min {deg.min()}, median {int(np.median(deg))}, max {deg.max()}"
            " (irregular: each node gathers a different number of messages)",
        ],
    }


def _load(people_ref: str, edges_ref: str) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    from gpuyard.data import open_dataset

    # A 2-D array is ingested as one column per feature: interests_0 .. interests_7.
    cols = [f"interests_{i}" for i in range(INTERESTS)]
    p = open_dataset(people_ref).to_numpy(["person", "age", *cols])
    e = open_dataset(edges_ref).to_numpy(["src", "dst", "bond"])
    order = np.argsort(p["person"])
    interests = np.stack([p[c][order] for c in cols], axis=1)
    x = np.concatenate([((p["age"][order] - 45) / 18)[:, None], interests], axis=1)
    return (
        x.astype(np.float32),
        e["src"].astype(np.int64),
        e["dst"].astype(np.int64),
        e["bond"].astype(np.float32),
    )


def build_model(in_features: int, hidden: int = 32, layers: int = 2) -> Any:
    """The edge-feature message-passing network and its pair scorer (one ``nn.Module``)."""
    import torch
    from torch import nn

    class EdgeConv(nn.Module):
        def __init__(self, dim_in: int, dim_out: int) -> None:
            super().__init__()
            self.msg = nn.Sequential(nn.Linear(dim_in + 1, dim_out), nn.ReLU(), nn.Linear(dim_out, dim_out))
            self.self_ = nn.Linear(dim_in, dim_out)

        def forward(
            self, h: torch.Tensor, src: torch.Tensor, dst: torch.Tensor, e: torch.Tensor
        ) -> torch.Tensor:
            m = self.msg(torch.cat([h[src], e[:, None]], dim=1))  # gather: rows in edge order
            agg = torch.zeros(h.shape[0], m.shape[1]).index_add_(0, dst, m)  # scatter to receivers
            deg = torch.zeros(h.shape[0]).index_add_(0, dst, torch.ones_like(e)).clamp(min=1)
            return torch.relu(self.self_(h) + agg / deg[:, None])

    class FriendNet(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            dims = [in_features] + [hidden] * layers
            self.convs = nn.ModuleList(EdgeConv(a, b) for a, b in itertools.pairwise(dims))
            self.score = nn.Sequential(nn.Linear(2 * hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))

        def forward(self, x: Any, src: Any, dst: Any, e: Any, pairs: Any) -> Any:
            # Messages flow both ways along a friendship.
            s, d, b = torch.cat([src, dst]), torch.cat([dst, src]), torch.cat([e, e])
            h = x
            for conv in self.convs:
                h = conv(h, s, d, b)
            hu, hv = h[pairs[:, 0]], h[pairs[:, 1]]
            return self.score(torch.cat([hu * hv, (hu - hv).abs()], dim=1)).squeeze(1)

    return FriendNet()


def _negatives(n: int, count: int, known: set[tuple[int, int]], rng: np.random.Generator) -> np.ndarray:
    out: list[tuple[int, int]] = []
    while len(out) < count:
        u, v = sorted(rng.integers(0, n, 2).tolist())
        if u != v and (u, v) not in known:
            out.append((u, v))
    return np.asarray(out, dtype=np.int64)


def train_stage(inputs: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """Train on 85% of the friendships, predict the held-out 15% against as many non-friend pairs."""
    import torch
    from sklearn.metrics import accuracy_score, roc_auc_score

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    x, src, dst, bond = _load(inputs["people"], inputs["friendships"])
    n, m = len(x), len(src)
    perm = rng.permutation(m)
    test_idx, train_idx = perm[: int(0.15 * m)], perm[int(0.15 * m) :]
    known = set(zip(src.tolist(), dst.tolist(), strict=True))
    test_pos = np.stack([src[test_idx], dst[test_idx]], 1)
    test_neg = _negatives(n, len(test_idx), known, rng)
    t = {
        k: torch.as_tensor(v)
        for k, v in {"x": x, "s": src[train_idx], "d": dst[train_idx], "b": bond[train_idx]}.items()
    }
    model = build_model(x.shape[1], int(inputs.get("hidden", 32)))
    opt = torch.optim.Adam(model.parameters(), lr=float(inputs.get("lr", 0.01)))
    loss_fn = torch.nn.BCEWithLogitsLoss()
    epochs = int(inputs.get("epochs", 60))
    pos_all = np.stack([src[train_idx], dst[train_idx]], 1)
    for _ in range(epochs):
        # Each epoch hides a quarter of the training edges from message passing and predicts them,
        # so the network cannot just look the answer up in its own input graph.
        hide = rng.random(len(train_idx)) < 0.25
        keep = torch.as_tensor(~hide)
        pos = pos_all[hide]
        neg = _negatives(n, len(pos), known, rng)
        pairs = torch.as_tensor(np.concatenate([pos, neg]))
        target = torch.cat([torch.ones(len(pos)), torch.zeros(len(neg))])
        opt.zero_grad()
        loss = loss_fn(model(t["x"], t["s"][keep], t["d"][keep], t["b"][keep], pairs), target)
        loss.backward()
        opt.step()
    model.eval()
    with torch.no_grad():
        pairs = torch.as_tensor(np.concatenate([test_pos, test_neg]))
        prob = torch.sigmoid(model(t["x"], t["s"], t["d"], t["b"], pairs)).numpy()
    truth = np.concatenate([np.ones(len(test_pos)), np.zeros(len(test_neg))])
    auc, acc = float(roc_auc_score(truth, prob)), float(accuracy_score(truth, prob > 0.5))
    return {
        "auc": auc,
        "accuracy": acc,
        "test_pairs": len(truth),
        "report": [
            f"trained {epochs} full-graph epochs on {len(train_idx)} friendships ({n} people),"
            f" final loss {loss.item():.4f}",
            f"held-out: {len(test_pos)} friendships vs {len(test_neg)} non-friend pairs:"
            f" ROC AUC {auc:.4f}, accuracy {acc:.4f}",
        ],
    }


def partition_stats(parts: np.ndarray, src: np.ndarray, dst: np.ndarray, k: int) -> dict[str, Any]:
    """Edges cut by a node partition, and the remote ("halo") nodes each part must fetch per layer."""
    cut = parts[src] != parts[dst]
    halo = []
    for p in range(k):
        mine_src, mine_dst = parts[src] == p, parts[dst] == p
        remote = np.union1d(dst[mine_src & cut], src[mine_dst & cut])
        halo.append(len(remote))
    return {
        "nodes": np.bincount(parts, minlength=k).tolist(),
        "cut_share": float(cut.mean()),
        "halo": halo,
    }


def shard_stage(inputs: dict[str, Any], ctx: dict[str, Any]) -> dict[str, Any]:
    """Cut the graph into ``parts`` shards by node hash and by age range; compare the edge cut."""
    x, src, dst, _ = _load(inputs["people"], inputs["friendships"])
    k, n = int(inputs.get("parts", 4)), len(x)
    hashed = (np.arange(n) * 2654435761 % 2**32) % k
    age = x[:, 0]
    ranked = np.argsort(np.argsort(age, kind="stable"), kind="stable")
    by_age = (ranked * k // n).astype(np.int64)
    out = {"hash": partition_stats(hashed, src, dst, k), "age_range": partition_stats(by_age, src, dst, k)}
    lines = [
        f"{k} shards of {n} people, {len(src)} friendships (each cut edge = one remote fetch per layer):"
    ]
    for name, s in out.items():
        lines.append(
            f"  {name:<9}: nodes per shard {s['nodes']}, edges cut {s['cut_share']:.1%},"
            f" halo nodes per shard {s['halo']}"
        )
    better = min(out, key=lambda key: out[key]["cut_share"])
    lines.append(f"  {better} keeps more friendships inside a shard (friends are close in age)")
    return {**out, "report": lines}
