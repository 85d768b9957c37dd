"""FPL: its key equations against values worked out by hand (baselines spec 4)."""
import math

import numpy as np
import pytest
import torch

from raysim.core.aggregation import Mean
from raysim.config import ModelConfig, TrainConfig
from raysim.methods.fpl import FPL, cluster_prototypes, finch, prototype_losses
from raysim import testing


def setup(name="small_cnn", n=3, size=16):
    return testing.setup(image_shape=(1, size, size), num_clients=n, model=ModelConfig(name=name, norm="bn"))


class _Augmented:
    """Six 1 x 2 x 2 images of classes (0, 0, 1, 1, 2, 2), served as x + 10 p in pass p (an augmentation
    that differs per epoch)."""

    def __init__(self):
        self.x = torch.arange(24.0).view(6, 1, 2, 2)
        self.y = torch.tensor([0, 0, 1, 1, 2, 2])
        self.num_train, self.passes = 6, 0

    def batches(self, batch_size, generator, device, drop_last=False):
        shift, self.passes = 10.0 * self.passes, self.passes + 1
        order = torch.randperm(6, generator=generator)
        for i in range(0, 6, batch_size):
            yield self.x[order[i:i + batch_size]] + shift, self.y[order[i:i + batch_size]]


def test_fpl_losses_by_hand():
    z, y = torch.tensor([[1.0, 0.0]]), torch.tensor([0])
    protos, labels = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([0, 1])
    cpcl, upcr = prototype_losses(z, y, protos, labels, tau=1.0)
    assert float(cpcl) == pytest.approx(math.log(1 + math.exp(-1)), abs=1e-5) and float(upcr) == 0.0
    # two prototypes of class 0 (both positive); the unbiased prototype is their mean [0.5, 0.5]
    protos, labels = torch.tensor([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0]]), torch.tensor([0, 0, 1])
    cpcl, upcr = prototype_losses(z, y, protos, labels, tau=1.0)
    e = math.e
    assert float(cpcl) == pytest.approx(-math.log((e + 1) / (e + 1 + 1 / e)), abs=1e-5)
    assert float(upcr) == pytest.approx((0.25 + 0.25) / 2)
    # a sample whose class has no prototype adds nothing (but counts in the batch size)
    cpcl2, _ = prototype_losses(torch.cat([z, z]), torch.tensor([0, 2]), protos, labels, tau=1.0)
    assert float(cpcl2) == pytest.approx(float(cpcl) / 2, abs=1e-6)


def test_finch_splits_by_direction_and_the_clusters_are_member_means():
    x = np.array([[1.0, 0.0], [0.99, 0.14], [0.0, 1.0], [0.14, 0.99]])
    last = finch(x)[-1]
    assert last[0] == last[1] and last[2] == last[3] and last[0] != last[2]
    assert finch(np.array([[1.0, 0.0], [0.0, 1.0]]))[-1].tolist() == [0, 0]  # two points: one cluster
    protos = cluster_prototypes([torch.tensor(r, dtype=torch.float32) for r in x])
    assert torch.allclose(protos[0], torch.tensor([0.995, 0.07])) and torch.allclose(protos[1], torch.tensor([0.07, 0.995]))
    assert torch.equal(cluster_prototypes([torch.tensor([3.0, 4.0])]), torch.tensor([[3.0, 4.0]]))


def test_fpl_server_broadcasts_per_class_clusters():
    m = FPL(FPL.Hparams(), setup())
    state = {"global": {"w": torch.zeros(1)}, "protos": torch.zeros(0, 2), "proto_labels": torch.zeros(0, dtype=torch.long)}
    extras = {0: {"protos": torch.tensor([[1.0, 0.0], [0.0, 1.0]]), "classes": torch.tensor([0, 2])},
              1: {"protos": torch.tensor([[0.9, 0.1]]), "classes": torch.tensor([0])}}
    new = m.aggregate(state, Mean({"w": torch.ones(1)}, 2.0, [0, 1], extras), 1)
    assert new["proto_labels"].tolist() == [0, 2]  # class 0: its two prototypes form one cluster
    assert torch.allclose(new["protos"][0], torch.tensor([0.95, 0.05])) and m.server_metrics(new) == {"prototypes": 2.0}


def test_fpl_prototypes_are_the_means_of_finchs_last_partition():
    """Four pairs of directions, 0/2, 20/22, 90/92 and 110/112 degrees: FINCH's first partition is the
    four pairs, its second (and last) the two groups {0..22} and {90..112}; a class gets two prototypes,
    the means of four members each (the first partition would give four)."""
    deg = [0, 2, 20, 22, 90, 92, 110, 112]
    x = torch.tensor([[math.cos(math.radians(d)), math.sin(math.radians(d))] for d in deg])
    levels = finch(x.double().numpy())
    assert [int(p.max()) + 1 for p in levels] == [4, 2]
    protos = cluster_prototypes(list(x))
    assert protos.shape == (2, 2)
    assert torch.allclose(protos[0], x[:4].mean(0), atol=1e-6) and torch.allclose(protos[1], x[4:].mean(0), atol=1e-6)


def test_fpl_local_prototypes_come_from_the_last_epoch():
    """features = flatten (no parameters: z = the image), E = 2: p_c = the class mean of the second
    pass's images, i.e. of x + 10 (both passes would give x + 5)."""
    from raysim.models.base import Net
    m = FPL(FPL.Hparams(), setup())
    model = Net(torch.nn.Flatten(), torch.nn.Linear(4, 3), (1, 2, 2))
    data = _Augmented()
    ctx = testing.client_context(m, model, data, state={}, train=TrainConfig(epochs=2, batch_size=4, lr=0.1),
                                 payload={"protos": torch.zeros(0, 4), "proto_labels": torch.zeros(0, dtype=torch.long)})
    up = m.local_update(ctx)
    assert data.passes == 2 and up.extras["classes"].tolist() == [0, 1, 2]
    expected = torch.stack([data.x[data.y == c].flatten(1).mean(0) + 10.0 for c in range(3)])
    assert torch.allclose(up.extras["protos"], expected)
