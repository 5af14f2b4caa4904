"""Fixtures for the data-management unit tests (shared with the integration tests)."""

from tests.data_fixtures import digits, digits_npz, image_folder

__all__ = ["digits", "digits_npz", "image_folder"]
