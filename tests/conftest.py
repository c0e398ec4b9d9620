"""Fixtures shared by several test modules."""

import sys

import pytest

from launch import REPO

sys.path.insert(0, str(REPO / "data_prep"))
from tiny_vlm import FAMILIES, save_tiny_vlm  # noqa: E402


@pytest.fixture(scope="session")
def tiny_vlms(tmp_path_factory):
    """Every tiny family checkpoint (data_prep/tiny_vlm.py), saved once per session: {family: directory}."""
    root = tmp_path_factory.mktemp("tiny_vlms")
    return {family: save_tiny_vlm(family, root / family) for family in FAMILIES}
