"""Kernel tests: tiny tensors, one intra-op thread (the CI box is 2 shared cores; threads only add contention)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
