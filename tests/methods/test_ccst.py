"""CCST: its key equations against values worked out by hand on tiny tensors (baselines spec 5.4)."""
import math

import pytest
import torch
import yaml

from raysim.core.aggregation import Mean
from raysim.config import ModelConfig
from raysim.core.errors import UserError
from raysim.methods.ccst import CCST, StyleSums, adain, adain_decoder, vgg_to_relu4_1
from raysim import testing


def setup(name="small_cnn", channels=1, size=16, n=3):
    return testing.setup(image_shape=(channels, size, size), num_clients=n, model=ModelConfig(name=name, norm="bn"))


def test_ccst_adain_pins_the_population_std():
    """Spec 5.4: one channel [1, 3], style (mu 10, sigma 2); mu_f = 2, population sigma_f = 1 (+1e-5
    under the root): [8, 12] (the unbiased sigma_f = sqrt 2 would give [8.586, 11.414])."""
    out = adain(torch.tensor([[[[1.0, 3.0]]]]), torch.tensor([[10.0]]), torch.tensor([[2.0]]))
    assert out.flatten().tolist() == pytest.approx([8.0, 12.0], abs=1e-4)


def test_ccst_overall_style_pools_every_pixel_of_every_image():
    """Pixels 0, 2 (image 1) and 4 (image 2): mu = 2, E[f^2] = 20/3, sigma = sqrt(20/3 - 4 + 1e-5) = sqrt(8/3)."""
    sums = StyleSums()
    sums.add(torch.tensor([[[[0.0, 2.0]]]]))
    sums.add(torch.tensor([[[[4.0]]]]))
    assert sums.style().flatten().tolist() == pytest.approx([2.0, math.sqrt(8 / 3 + 1e-5)], abs=1e-6)


def test_ccst_each_image_gets_k_distinct_styles_and_keeps_its_own():
    """Two clients, K = 2, identity normalisation: each image appears once as itself (own style) and
    once in client 1's style (pixel mean 0.5, std 0.1)."""
    m = CCST(CCST.Hparams.from_dict({"k": 2}), setup())
    x = torch.rand(3, 1, 4, 4, generator=torch.Generator().manual_seed(1)) * 0.5
    y = torch.tensor([0, 1, 2])
    bank = {0: torch.tensor([[0.3], [0.2]]), 1: torch.tensor([[0.5], [0.1]])}
    one = torch.ones(1, 1, 1, 1)
    xs, ys = m.augment(x, y, [0, 1], bank, 0, 2, 0 * one, one, torch.Generator().manual_seed(0))
    assert xs.shape == (6, 1, 4, 4) and sorted(ys.tolist()) == [0, 0, 1, 1, 2, 2]
    own = [i for i in range(6) if any(torch.equal(xs[i], x[j]) for j in range(3))]
    styled = [i for i in range(6) if i not in own]
    assert len(own) == 3 and len(styled) == 3
    for i in styled:
        assert float(xs[i].mean()) == pytest.approx(0.5, abs=1e-5)
        v = float(x[ys[i]].var(unbiased=False))  # sigma_f^2: the std becomes 0.1 * sigma_f / sqrt(sigma_f^2 + 1e-5)
        assert float(xs[i].std(unbiased=False)) == pytest.approx(0.1 * math.sqrt(v / (v + 1e-5)), abs=1e-5)


def test_ccst_feature_variant_needs_its_weights_and_runs_with_them(tmp_path):
    with pytest.raises(UserError, match="encoder_path"):
        CCST.Hparams.from_dict({"variant": "feature"})
    with pytest.raises(UserError, match="no such file"):
        CCST.Hparams.from_dict({"variant": "feature", "encoder_path": str(tmp_path / "vgg.pth"),
                                "decoder_path": str(tmp_path / "dec.pth")})
    torch.save(vgg_to_relu4_1().state_dict(), tmp_path / "vgg.pth")
    torch.save(adain_decoder().state_dict(), tmp_path / "dec.pth")
    hp = CCST.Hparams.from_dict({"variant": "feature", "encoder_path": str(tmp_path / "vgg.pth"),
                                 "decoder_path": str(tmp_path / "dec.pth")})
    m = CCST(hp, setup())
    x = torch.rand(2, 1, 16, 16)
    assert m.encode(x).shape == (2, 512, 2, 2)
    out = m.stylise(x, torch.rand(2, 2, 512))
    assert out.shape == x.shape and float(out.min()) >= 0 and float(out.max()) <= 1


def test_ccst_server_bank_and_summary_name_the_variant(tmp_path):
    m = CCST(CCST.Hparams(), setup())
    state = m.init_server(m.build_model())
    state = m.aggregate(state, Mean(state["global"], 1.0, [1], {1: {"style": torch.ones(2, 1)}}), 1)
    assert list(m.broadcast(state, 2)["styles"]) == [1]
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({"method": "ccst", "hp": {"ccst": {"variant": "image"}}}))
    from raysim.app import rundir
    assert "`image`" in CCST.report_markdown(rundir.read_config(str(tmp_path)), None) and "style" in CCST.exchanges
