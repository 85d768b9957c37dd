"""Update compression (raysim.core.compression) against values computed by hand."""
import torch

from raysim.core.compression import quantize, topk
from raysim.core.seeding import generator_for


def test_topk_keeps_exactly_k_entries_and_the_residual_carries_the_rest():
    update = {"a": torch.tensor([0.1, -3.0, 0.2]), "b": torch.tensor([[2.0, -0.05], [0.0, 1.0]]),
              "n": torch.tensor(4)}
    sent, residual, nbytes = topk(update, fraction=3 / 7, residual=None)  # d = 7 floats, k = 3
    assert torch.equal(sent["a"], torch.tensor([0.0, -3.0, 0.0]))
    assert torch.equal(sent["b"], torch.tensor([[2.0, 0.0], [0.0, 1.0]]))
    assert sum(int(torch.count_nonzero(sent[k])) for k in ("a", "b")) == 3
    assert torch.equal(residual["a"], torch.tensor([0.1, 0.0, 0.2]))
    assert torch.equal(residual["b"], torch.tensor([[0.0, -0.05], [0.0, 0.0]]))
    assert sent["n"] is update["n"] and "n" not in residual
    assert nbytes == 3 * (4 + 4) + 8  # k values and k indices, and the int64 buffer as it is


def test_topk_adds_the_residual_before_choosing():
    update = {"a": torch.tensor([1.0, 0.5, 0.0])}
    sent, residual, _ = topk(update, fraction=1 / 3, residual={"a": torch.tensor([0.0, 0.6, 0.0])})
    assert torch.equal(sent["a"], torch.tensor([0.0, 1.1, 0.0]))  # 0.5 + 0.6 outranks 1.0
    assert torch.equal(residual["a"], torch.tensor([1.0, 0.0, 0.0]))


def test_quantizer_is_unbiased_over_draws_and_lands_on_its_levels():
    v = {"w": torch.tensor([0.3, -0.7, 0.05, 0.0, 1.2])}
    norm = float(v["w"].double().norm())
    total = torch.zeros(5, dtype=torch.float64)
    draws = 4000
    for r in range(draws):
        q, nbytes = quantize(v, bits=3, generator=generator_for(0, r, 0, "quantize"))  # s = 3 levels
        levels = q["w"].double().abs() / norm * 3
        assert torch.allclose(levels, levels.round(), atol=1e-5)  # |q_i| = ||v|| l / s
        total += q["w"].double()
    assert nbytes == 2 + 4  # ceil(5 x 3 bits / 8) and the float32 norm
    # each entry's std is at most ||v|| / (2 s) ~ 0.24: its mean over 4000 draws is within ~0.004
    assert torch.allclose(total / draws, v["w"].double(), atol=0.02)


def test_quantizer_keeps_zero_tensors_and_signs():
    q, _ = quantize({"z": torch.zeros(3), "s": torch.tensor([-1.0, 1.0])}, bits=8, generator=generator_for(0, 1, 0, "q"))
    assert torch.equal(q["z"], torch.zeros(3))
    assert torch.equal(q["s"].sign(), torch.tensor([-1.0, 1.0]))
