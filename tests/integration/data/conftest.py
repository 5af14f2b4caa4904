"""Fixtures for the data-management integration tests (shared with the unit tests)."""

from tests.data_fixtures import digits, digits_npz, image_folder

__all__ = ["digits", "digits_npz", "image_folder"]
