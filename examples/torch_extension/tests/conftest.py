"""Builds and loads the extension once per test session.

The build goes to $MRR_TORCH_EXT_BUILD_DIR when set (a persistent folder makes reruns take
seconds), else to a fresh temporary folder (a cold build, about a minute).
"""

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # examples/torch_extension: the mrr_torch package

import mrr_torch  # noqa: E402


@pytest.fixture(scope="session")
def mt(tmp_path_factory):
    """The mrr_torch package with the extension loaded (its C++ names re-exported)."""
    build_dir = os.environ.get("MRR_TORCH_EXT_BUILD_DIR") or str(tmp_path_factory.mktemp("mrr_torch_build"))
    mrr_torch.load(build_dir=build_dir)
    return mrr_torch


@pytest.fixture
def repo_root():
    return HERE.parents[2]
