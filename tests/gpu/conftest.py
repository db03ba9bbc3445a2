import pytest
import torch

from gpu.model import LoadedModel, load_model
from gpu.model_source import DEFAULT_MODEL


@pytest.fixture(autouse=True, scope="package")
def one_thread():
    """Test shapes are tiny: one thread avoids OpenMP barrier stalls on a shared, busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2(settings) -> LoadedModel:
    """The real default model, loaded once per session from the user's cache (converted there once)."""
    return load_model(DEFAULT_MODEL, "float32", "cpu", cache_dir=settings.cache_dir)
