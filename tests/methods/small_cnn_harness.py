"""What the tests of Ditto, SCAFFOLD, FedDyn, PartialFed, LG-FedAvg and MOON share: a federation of
1 x 8 x 8 images (``setup``), the small_cnn with BN it trains (``small``), one client's round on it
(``context``) and a one-parameter model for the equations worked out by hand on scalars (``Scalar``).
Imported as ``from small_cnn_harness import ...``: pytest puts this folder on ``sys.path``."""
import torch
from torch import nn

from raysim.config import TrainConfig
from raysim.models import build
from raysim import testing
from raysim.testing import client_context, random_client_data


def setup(n=2, **kw):
    return testing.setup(num_clients=n, **kw)  # 3 classes of 1 x 8 x 8 images, small_cnn with BN, 3 rounds


def small(seed=0):
    torch.manual_seed(seed)
    return build("small_cnn", num_classes=3, in_channels=1, input_size=8, norm="bn")


def context(method, model, payload, state, cid=0, rnd=2, lr=0.1, epochs=1, data=None):
    return client_context(method, model, data or random_client_data(seed=cid), client_id=cid, round=rnd,
                          payload=payload, state=state, train=TrainConfig(epochs=epochs, batch_size=4, lr=lr), seed=7)


class Scalar(nn.Module):
    def __init__(self, value=0.0):
        super().__init__()
        self.theta = nn.Parameter(torch.tensor([value]))
