import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors run faster on one thread, and the suite shares two cores."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
