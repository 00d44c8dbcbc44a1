import pytest
import torch


@pytest.fixture
def one_torch_thread():
    """2 shared cores: a tensor-parallel test's ranks each run one thread (followers get this
    process's threads // N, at least 1)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
