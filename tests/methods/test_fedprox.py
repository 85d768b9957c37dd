"""FedProx's proximal term on tiny tensors, computed by hand."""
import torch

from raysim.methods.fedprox import proximal_term


def test_fedprox_proximal_term_by_hand():
    w = {"a": torch.tensor([1.0, 2.0]), "b": torch.tensor([[3.0]])}
    anchor = {"a": torch.tensor([0.0, 0.0]), "b": torch.tensor([[1.0]])}
    # (mu/2) * (1 + 4 + 4) = 0.05 * 9 = 0.45 with mu = 0.1
    assert abs(proximal_term(w, anchor, 0.1).item() - 0.45) < 1e-7


def test_fedprox_gradient_pulls_toward_anchor():
    p = torch.tensor([2.0], requires_grad=True)
    proximal_term({"p": p}, {"p": torch.tensor([0.5])}, 0.2).backward()
    assert torch.allclose(p.grad, torch.tensor([0.2 * 1.5]))
