"""Fixtures of the pipeline tests: the examples' folder and their YAML documents."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"


@pytest.fixture
def example_doc() -> Any:
    """Load ``examples/<name>/pipeline.yaml`` as a document (tests shrink its settings)."""

    def load(name: str) -> tuple[dict[str, Any], Path]:
        folder = EXAMPLES / name
        return yaml.safe_load((folder / "pipeline.yaml").read_text()), folder

    return load
