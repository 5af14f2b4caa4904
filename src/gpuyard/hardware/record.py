"""Keep each node's latest inventory in the state store (table ``nodes``, one row per hostname)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError as SqlIntegrityError

from gpuyard.hardware.inventory import NodeInventory
from gpuyard.store.db import Store, get_store
from gpuyard.store.tables.core import NodeRow


def record_inventory(inventory: NodeInventory, store: Store | None = None) -> None:
    """Insert or replace the ``nodes`` row of ``inventory.hostname``.

    Args:
        inventory: the probe result; its ``to_dict()`` document and node health are stored.
        store: the state store (default: the configured one).

    Raises:
        StoreError: the database cannot be reached.
    """
    store = store or get_store()
    doc, health = inventory.to_dict(), inventory.health
    for attempt in range(2):
        try:
            with store.session() as s:
                row = s.get(NodeRow, inventory.hostname)
                if row is None:
                    s.add(NodeRow(hostname=inventory.hostname, inventory=doc, health=health))
                else:
                    row.inventory, row.health = doc, health
            return
        except SqlIntegrityError:
            # Another process inserted the same hostname between our read and our insert: update it.
            if attempt:
                raise


def recorded_nodes(store: Store | None = None) -> list[dict[str, Any]]:
    """Every recorded node: ``{"hostname", "health", "updated_at", "inventory"}``, by hostname."""
    store = store or get_store()
    with store.read() as s:
        rows = s.scalars(select(NodeRow).order_by(NodeRow.hostname)).all()
        return [
            {
                "hostname": r.hostname,
                "health": r.health,
                "updated_at": r.updated_at.isoformat(),
                "inventory": r.inventory,
            }
            for r in rows
        ]
