"""PartialFed-Fix — Sun, Huo, Yang, Bai, "PartialFed: Cross-Domain Personalized Federated Learning
via Partial Initialization", NeurIPS 2021.

The server runs FedAvg over the full uploaded models. Client c keeps its model theta_c from the
end of its last participation and builds its starting point layer by layer:
    init[l] = theta^t[l]    for the layers it loads (the strategy A_c[l] = 1),
            = theta_c[l]    for the layers it keeps (A_c[l] = 0)
then trains every layer and uploads every layer: unlike FedBN, kept layers are still averaged
into the global model; only the client's starting point is personal. Its first participation
loads everything. Each client is scored with its partially initialised model.

PartialFed-Fix: one hand-set strategy for every client. The paper reports that loading the lower
layers and keeping BN and the classifier works best; ``keep`` = ["bn", "head"] by default (spec
3.3's recommendation; "bn": every norm layer, affine and statistics; "head": the classifier; any
other entry: a module-name prefix). PartialFed-Adaptive learns A_c per client; its update rule is
not stated in a form we could implement, so it is not provided.

Where the default comes from (``raysim methods partialfed``): no code was released and the paper's
per-experiment strategies were not read, so ``keep`` is spec 3.3's recommendation built from the
paper's reported findings (partial loading beats full loading; keeping BN and the classifier
helps). FDSE, which ran PartialFed in its Table 1, does not say which strategy it used.
"""
from __future__ import annotations

from dataclasses import dataclass

from raysim.core.contract import ClientContext, Method, Upload
from raysim.core.hparams import Hparams
from raysim.models.norm import is_norm
from raysim.core.settings import setting
from raysim.core.tensors import load_tensors
from raysim.core.training import train_epochs


@dataclass(frozen=True)
class PartialFedHparams(Hparams):
    keep: tuple[str, ...] = setting(("bn", "head"), source="spec 3.3 [R], from the paper's findings (no code released)", doc="the layers a client keeps from its own last model")


def kept_keys(model, keep: tuple[str, ...]) -> set[str]:
    """State-dict keys of the layers named by ``keep``."""
    prefixes = []
    for entry in keep:
        if entry == "bn":
            prefixes += [n for n, m in model.named_modules() if n and is_norm(m)]
        else:
            prefixes.append(entry)
    return {k for k in model.state_dict() if any(k == p or k.startswith(p + ".") for p in prefixes)}


class PartialFed(Method):
    name = "partialfed"
    Hparams = PartialFedHparams
    paper = "Sun et al., NeurIPS 2021 (PartialFed-Fix)"
    shares = 'shares the whole model; keeps its last model for a partial (layer-wise) initialization'

    def load_client_model(self, model, payload, state):
        """theta^t, then the kept layers from the client's own last model (if it has one)."""
        load_tensors(model, payload["global"])
        own = state.get("model")
        if own is not None:
            keep = kept_keys(model, self.hp.keep)
            load_tensors(model, {k: v for k, v in own.items() if k in keep})

    def local_update(self, ctx: ClientContext) -> Upload:
        stats = train_epochs(ctx)
        ctx.state["model"] = {k: v.detach().cpu().clone() for k, v in ctx.model.state_dict().items()}
        return self.upload(ctx, stats)
