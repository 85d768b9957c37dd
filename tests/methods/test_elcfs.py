"""ELCFS: its key equations against values worked out by hand on tiny tensors (baselines spec 5.3)."""
import math

import pytest
import torch
from torch import nn

from raysim.core.aggregation import Mean
from raysim.config import ModelConfig, TrainConfig
from raysim.core.errors import UserError
from raysim.methods.elcfs import (ELCFS, amplitude_window, boundary_loss, episodic_loss, half_width, inner_step,
                                  interpolate_amplitude)
from raysim.models.base import Net
from raysim import testing


def setup(name="small_cnn", channels=1, size=16, n=3):
    return testing.setup(image_shape=(channels, size, size), num_clients=n, model=ModelConfig(name=name, norm="bn"))


def _pixels():
    """A client's data for ELCFS's client step: four 1 x 8 x 8 images normalised with (0.5, 0.25)."""
    g = torch.Generator().manual_seed(0)
    x, y = (torch.rand(4, 1, 8, 8, generator=g) - 0.5) / 0.25, torch.randint(0, 3, (4,), generator=g)
    return testing.client_data(x, y, normalisation=((0.5,), (0.25,)))


def test_elcfs_dc_swap_moves_the_mean_and_keeps_the_rest():
    """Spec 5.3's test (r = 0, lambda = 1): x = [[0, 1], [2, 3]] (mean 1.5, DC = 6); the donor's DC is
    |4 * 5| = 20, so every pixel moves by (20 - 6) / 4 = 3.5: x' = x - 1.5 + 5."""
    x = torch.tensor([[[[0.0, 1.0], [2.0, 3.0]]]])
    donor = amplitude_window(torch.full((1, 1, 2, 2), 5.0), 0)
    assert donor.flatten().tolist() == pytest.approx([20.0])
    out = interpolate_amplitude(x, donor, torch.tensor([1.0]), 0)
    assert out.flatten().tolist() == pytest.approx([3.5, 4.5, 5.5, 6.5], abs=1e-6)
    assert float(out.mean()) == pytest.approx(5.0) and torch.allclose(out - out.mean(), x - x.mean())
    # lambda = 1/4: A_DC = 3/4 * 6 + 1/4 * 20 = 9.5, every pixel moves by (9.5 - 6) / 4 = 0.875
    out = interpolate_amplitude(x, donor, torch.tensor([0.25]), 0)
    assert out.flatten().tolist() == pytest.approx([0.875, 1.875, 2.875, 3.875], abs=1e-6)


def test_elcfs_window_mixes_only_the_low_frequencies():
    """x[h, w] = cos(2 pi w / 4) = [1, 0, -1, 0] on every row of a 4 x 4 image: |FFT| is 8 at (0, 1) and
    (0, 3), i.e. (2, 3) and (2, 1) after fftshift, both inside the b = 1 window (rows and columns 1..3).
    A zero donor at lambda = 1/2 halves both amplitudes, the phase stays: x' = x / 2. With b = 0 only
    the DC (0 here) is mixed: x' = x."""
    x = torch.tensor([1.0, 0.0, -1.0, 0.0]).expand(4, 4).reshape(1, 1, 4, 4).clone()
    win = amplitude_window(x, 1)
    assert win.shape == (1, 1, 3, 3) and win[0, 0, 1].tolist() == pytest.approx([8.0, 0.0, 8.0], abs=1e-5)
    out = interpolate_amplitude(x, torch.zeros(1, 1, 3, 3), torch.tensor([0.5]), 1)
    assert torch.allclose(out, x / 2, atol=1e-6)
    assert torch.allclose(interpolate_amplitude(x, torch.zeros(1, 1, 1, 1), torch.tensor([0.5]), 0), x, atol=1e-6)
    # the sine [0, 1, 0, -1] is the cosine shifted by one pixel: same amplitudes (8, imaginary FFT), same halving
    s = torch.roll(x, 1, dims=-1)
    assert torch.allclose(amplitude_window(s, 1), win, atol=1e-5)
    assert torch.allclose(interpolate_amplitude(s, torch.zeros(1, 1, 3, 3), torch.tensor([0.5]), 1), s / 2, atol=1e-6)
    # b = floor(min(H, W) r): 2 at 224 px, 0 at 28 px (spec 5.3 pitfall 1), kept inside the image
    assert (half_width(224, 224, 0.01), half_width(28, 28, 0.01), half_width(4, 4, 0.49)) == (2, 0, 1)


def test_elcfs_inner_step_clips_each_gradient_element():
    """theta' = theta - beta clip(g, -c, c): beta 0.1, c 100: 1 - 0.1 * 100 = -9, 2 - 0.1 * (-0.5) = 2.05."""
    fast = inner_step({"w": torch.tensor([1.0, 2.0])}, [torch.tensor([150.0, -0.5])], 0.1, 100.0)
    assert fast["w"].tolist() == pytest.approx([-9.0, 2.05])


def test_elcfs_episodic_loss_and_its_first_order_gradient_by_hand():
    """f = flatten then W (2 x 2, zero), x = [1, 0], x' = [2, 0], y = 0, beta = 1.
    L_in = log 2; dL_in/dW = (softmax - onehot) x^T = [[-0.5, 0], [0.5, 0]]; W' = -g = [[0.5, 0], [-0.5, 0]];
    logits' = W' x' = [1, -1]: L_out = log(1 + e^-2) = 0.126928; dL_out/dW' = [-s, s] x'^T with
    s = 1 / (1 + e^2) = 0.119203: [[-0.238406, 0], [0.238406, 0]]. First order: the gradient is the sum."""
    model = Net(nn.Sequential(nn.Flatten()), nn.Linear(2, 2, bias=False), (1, 1, 2))
    nn.init.zeros_(model.head.weight)
    x, x_out, y = torch.tensor([[[[1.0, 0.0]]]]), torch.tensor([[[[2.0, 0.0]]]]), torch.tensor([0])
    loss = episodic_loss(model, x, y, x_out, beta=1.0, clip=100.0)
    assert float(loss.detach()) == pytest.approx(math.log(2) + math.log(1 + math.exp(-2)), abs=1e-6)
    loss.backward()
    s = 1 / (1 + math.exp(2))
    assert model.head.weight.grad.flatten().tolist() == pytest.approx([-0.5 - 2 * s, 0, 0.5 + 2 * s, 0], abs=1e-6)


def test_elcfs_boundary_loss_by_hand():
    """z = [1, 0], [1, 0], [0, 1] with labels 0, 0, 1, tau = 1: cos = [[1, 1, 0], [1, 1, 0], [0, 0, 1]].
    Anchors 0 and 1: -log(e / (e + 1)) = log(e + 1) - 1 = 0.313262; anchor 2 has no positive."""
    z, y = torch.tensor([[1.0, 0.0], [2.0, 0.0], [0.0, 3.0]]), torch.tensor([0, 0, 1])
    assert float(boundary_loss(z, y, 1.0)) == pytest.approx(math.log(math.e + 1) - 1, abs=1e-6)
    assert float(boundary_loss(z, torch.tensor([0, 1, 2]), 1.0)) == 0.0


def test_elcfs_server_keeps_each_clients_spectra_and_broadcasts_them():
    m = ELCFS(ELCFS.Hparams(), setup())
    state = m.init_server(m.build_model())
    g = state["global"]
    extras = {0: {"amplitudes": torch.ones(4, 1, 1, 1)}, 2: {"amplitudes": torch.zeros(3, 1, 1, 1)}}
    state = m.aggregate(state, Mean(g, 2.0, [0, 2], extras), 1)
    state = m.aggregate(state, Mean(g, 1.0, [1], {1: {}}), 2)  # a round without new spectra keeps the bank
    assert sorted(m.broadcast(state, 3)["bank"]) == [0, 2] and m.server_metrics(state) == {"bank_clients": 2.0}
    assert "amplitude" in ELCFS.exchanges and ELCFS.Hparams().r == 0.01
    with pytest.raises(UserError):
        ELCFS.Hparams.from_dict({"r": 0.5})


def test_elcfs_client_never_draws_its_own_spectra():
    """A client draws from the *other* clients' spectra: with only its own in the bank it trains on
    L_in alone (FedAvg's step, the same batches); another client's spectra make the step episodic."""
    from raysim.methods.fedavg import FedAvg
    m = ELCFS(ELCFS.Hparams(), setup(size=8))
    model = m.build_model()
    start = {k: v.clone() for k, v in model.state_dict().items()}
    own, other = torch.rand(3, 1, 1, 1) * 30, torch.rand(3, 1, 1, 1) * 30

    def step(method, bank):
        model.load_state_dict(start)
        ctx = testing.client_context(method, model, _pixels(), round=2, payload={"global": start, "bank": bank},
                                     state={"uploaded": True}, train=TrainConfig(batch_size=4, lr=0.1), seed=7)
        return {k: v.clone() for k, v in method.local_update(ctx).tensors.items()}
    fedavg = step(FedAvg(FedAvg.Hparams(), setup(size=8)), {})
    alone = step(m, {0: own})
    assert all(torch.equal(alone[k], fedavg[k]) for k in fedavg)
    assert not torch.equal(step(m, {0: own, 1: other})["head.weight"], fedavg["head.weight"])


def test_elcfs_lambda_is_drawn_uniformly_per_sample():
    """r = 0 (the DC term): a constant 0.2 image mixed with a constant 0.8 donor is 0.2 + 0.6 lambda, so
    each sample's lambda can be read back; lambda ~ U(0, 1), one per sample (not 1: a full swap)."""
    m = ELCFS(ELCFS.Hparams(), setup())
    x = torch.full((32, 1, 4, 4), 0.2)
    others = [amplitude_window(torch.full((1, 1, 4, 4), 0.8), 0)]
    zero, one = torch.zeros(1, 1, 1, 1), torch.ones(1, 1, 1, 1)
    out = m.interpolate(x, others, zero, one, 0, torch.Generator().manual_seed(0))
    lam = (out.mean(dim=(1, 2, 3)) - 0.2) / 0.6
    assert torch.allclose(out, out.mean(dim=(2, 3), keepdim=True), atol=1e-6)  # still constant images
    assert float(lam.min()) > 0 and float(lam.max()) < 1 and float(lam.max() - lam.min()) > 0.5


def test_elcfs_interpolated_image_is_clipped_to_the_pixel_range():
    """x' is clipped to [0, 1] before normalisation (mean 0.5, std 0.25): a 0/1 checkerboard (mean 0.5)
    mixed at r = 0 with a constant 1 donor moves every pixel up by lambda / 2, so its ones are clipped
    at 1 and its zeros become lambda / 2 > 0; with a constant 0 donor the zeros are clipped at 0."""
    m = ELCFS(ELCFS.Hparams(), setup())
    board = (torch.arange(4)[:, None] + torch.arange(4)[None, :]) % 2
    x01 = board.float().expand(6, 1, 4, 4)
    mean, std = torch.full((1, 1, 1, 1), 0.5), torch.full((1, 1, 1, 1), 0.25)
    ones = board.bool().expand(6, 1, 4, 4)
    for donor, clipped, moved in ((1.0, ones, ~ones), (0.0, ~ones, ones)):
        others = [amplitude_window(torch.full((1, 1, 4, 4), donor), 0)]
        out = m.interpolate((x01 - mean) / std, others, mean, std, 0, torch.Generator().manual_seed(1)) * std + mean
        assert torch.allclose(out[clipped], torch.full_like(out[clipped], float(donor)), atol=1e-6)
        assert float(out.min()) >= -1e-6 and float(out.max()) <= 1 + 1e-6
        assert float((out[moved] - x01[moved]).abs().min()) > 0  # lambda > 0: unclipped, these would leave [0, 1]
