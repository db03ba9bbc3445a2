import pytest
import torch


@pytest.fixture(autouse=True, scope="package")
def one_thread():
    """Test shapes are tiny: one thread avoids OpenMP barrier stalls on a shared, busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
