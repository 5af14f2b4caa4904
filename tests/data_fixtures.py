"""Data-management test fixtures: small sources written into tmp_path (digits, CSV, image folders).

Imported by the conftest.py of tests/unit/data and tests/integration/data.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest


@pytest.fixture(scope="session")
def digits() -> tuple[np.ndarray, np.ndarray]:
    """scikit-learn's digits (offline): images (1797, 8, 8) uint8 0..16 and labels."""
    from sklearn.datasets import load_digits

    d = load_digits()
    return d.images.astype(np.uint8), d.target.astype(np.int64)


@pytest.fixture
def digits_npz(tmp_path: Path, digits: tuple[np.ndarray, np.ndarray]) -> Path:
    """digits as .npz: ``pixels`` (N, 64) float, ``image`` (N, 8, 8) uint8, ``label``."""
    images, labels = digits
    path = tmp_path / "digits.npz"
    np.savez(path, pixels=images.reshape(len(images), -1).astype(np.float64), image=images, label=labels)
    return path


@pytest.fixture
def image_folder(tmp_path: Path, digits: tuple[np.ndarray, np.ndarray]) -> Path:
    """A folder per class (0, 1, 2) of 8x8 PNGs from digits, plus one corrupt PNG in class 1."""
    from PIL import Image

    images, labels = digits
    root = tmp_path / "imgs"
    for cls in (0, 1, 2):
        (root / str(cls)).mkdir(parents=True)
        for i in np.flatnonzero(labels == cls)[:20]:
            Image.fromarray(images[i] * 15).save(root / str(cls) / f"{i:04d}.png")
    (root / "1" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really a png")
    return root
