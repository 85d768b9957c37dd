"""Power-of-Choice — Cho, Wang, Joshi, "Towards Understanding Biased Client Selection in
Federated Learning", AISTATS 2022 (arXiv 2010.01243): FedAvg whose clients are chosen by
Power-of-Choice, pow-d by default (the selection's steps: :mod:`raysim.core.selection`):

    1. candidates A: d clients drawn without replacement, client k with probability p_k = n_k / n
    2. each k in A computes F_k(w^t), its local loss of the global model, and sends it
    3. S^t: the m clients of A with the highest F_k(w^t)
    4. the clients of S^t train; w^{t+1} = (1/m) Σ_{k ∈ S^t} w_k^{t+1}, their equal mean

The selection composes with any method and server step as ``clients.selection: {kind:
power_of_choice}``; this method is the paper's algorithm, FedAvg with that selection and step 4's
equal mean (by the defaults rule: the paper's update). ``method: fedavg`` with the selection keeps
FedAvg's n_k-weighted mean.
"""
from __future__ import annotations

from dataclasses import dataclass

from raysim.core.contract import ClientContext, LocalLoss, Method, Upload, cross_entropy
from raysim.core.errors import UserError
from raysim.core.hparams import Hparams
from raysim.core.selection import PowerOfChoice as PowerOfChoiceSelection, Selection
from raysim.core.settings import setting


@dataclass(frozen=True)
class PowerOfChoiceHparams(Hparams):
    d: int | None = setting(None, ge=1, source="ours: 2m, the smallest d of the paper's FMNIST runs (m = 3, d in {6, 9, 15}; the Flower baseline's default d = 6)",
                            doc="candidates per round, at least m; null: 2m")
    variant: str = setting("pow-d", one_of=("pow-d", "rpow-d"), source="paper: pow-d, the base strategy (cpow-d and rpow-d are its cheaper variants)",
                           doc="rpow-d: the clients' last training losses, no query")


class PowerOfChoice(Method):
    name = "powerofchoice"
    Hparams = PowerOfChoiceHparams
    paper = "Cho, Wang, Joshi, AISTATS 2022"
    shares = ('shares the whole model; keeps nothing; pow-d candidates send their local loss of the global model, '
              'rpow-d clients their training loss')

    def selection(self, configured: Selection) -> Selection:
        if configured.kind != "uniform":
            raise UserError(f"method powerofchoice is FedAvg with Power-of-Choice's selection (hp.powerofchoice); "
                            f"clients.selection.kind={configured.kind} would replace it: run method fedavg with it")
        return PowerOfChoiceSelection(d=self.hp.d, variant=self.hp.variant, where="hp.powerofchoice")

    def upload(self, ctx: ClientContext, stats: dict) -> Upload:
        up = super().upload(ctx, stats)
        up.weight = 1.0  # step 4: the selected clients' equal mean
        return up

    def local_loss(self, ctx: ClientContext) -> LocalLoss:
        return LocalLoss(cross_entropy)  # client cohorts: FedAvg's step
