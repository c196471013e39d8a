"""Shared fixtures; GPU-marked tests are skipped where no CUDA device is visible."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels run in its interpreter on the CPU; it must be chosen before triton loads.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
