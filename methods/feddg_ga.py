"""FedDG-GA — R. Zhang, Q. Xu, J. Yao, Y. Zhang, Q. Tian, Y. Wang, "Federated Domain Generalization
with Generalization Adjustment", CVPR 2023 (Alg. 1; baselines spec 5.2).

Server state: the global model theta and one aggregation weight a_k per client, a_k = 1/N at first.
Round r (1-based):
    client k: theta_k <- E epochs of SGD on the CE from theta^{r-1};
              m_k^before = its validation metric of theta_k
    server:   theta^r = sum_k a_k theta_k / sum_{k in S} a_k        (every state entry, BN buffers too)
    client k: m_k^after = its validation metric of theta^r
    server:   G_k = m_k^after - m_k^before                            (the generalization gap)
              G^_k = G_k / max_j |G_j|
              a_k <- clip(a_k + s d_r G^_k, 0, 1), then renormalised to sum 1
              s = -1 for the accuracy, +1 for the loss (a client that lost most gains weight)
              d_r = (d - (r - 2) d / R) / N                            (linear decay over R rounds)
The step m_k^after needs no extra message: client k scores the theta^r it receives at the start of
round r + 1 and uploads G_k with its new model; the server updates a before aggregating round r + 1.
This is the same computation in the same order (the a_k used to aggregate round r + 1 are the
ones updated from theta^r's gaps). A client keeps m_k^before (and its round) between rounds.

Where the defaults come from (the released code, MediaBrain-SJTU/FedDG-GA; ``raysim methods
feddg_ga`` lists each one's source):
* d = 0.2: the code's ``--step_size`` (the paper's d is not reported);
* metric ``acc``: the code's ``--fair acc`` default, which the README command keeps; the paper
  calls the gap a "generalization gap" of the loss: ``metric: loss`` switches (spec 5.2 pitfall 1);
* the decay's round index: the code's loop counts rounds from 0 and adjusts after round i with
  d - (i - 1) d / R, i.e. d - (r - 2) d / R for the 1-based round r whose global model the gaps
  were measured on (the first adjustment steps (1 + 1/R) d, not d);
* the gaps are not centred (the code; the paper is unclear): ``centre: true`` subtracts the mean
  gap first (ours).

Deviations (spec 5.2 "pitfalls"):
* 1/N in d_r where the code hard-codes 1/3 (its three source domains): identical for N = 3;
* R is the run's number of rounds; the code runs R + 1 rounds (its loop is range(R + 1)) and
  decays over R, so a run of R rounds here decays by d / R per round where the code, run for as
  many rounds, would decay by d / (R - 1);
* all gaps 0 (or none measured): no update;
* fresh optimizers every round (the code keeps per-client SGD momentum across rounds);
* a gap counts only when the client also trained in round r, so that theta^r holds its model;
  under partial participation the weights of the round's clients are renormalised among them.
"""
from __future__ import annotations

from dataclasses import dataclass

from raysim.core.aggregation import KeepAll, weighted_mean
from raysim.core.contract import ClientContext, Method, Upload
from raysim.core.hparams import Hparams, Space
from raysim.core.settings import setting
from raysim.core.training import evaluate, train_epochs


@dataclass(frozen=True)
class FedDGGAHparams(Hparams):
    step_size: float = setting(0.2, gt=0, le=1, source="official code (MediaBrain-SJTU/FedDG-GA, --step_size)", doc="d; the paper's is not reported")
    metric: str = setting("acc", one_of=("acc", "loss"), source="official code (--fair acc; spec 5.2 pitfall 1)", doc="acc: the code's | loss: the paper's gap")
    centre: bool = setting(False, source="official code (no centring; the paper is unclear)", doc="true: subtract the mean gap first (ours)")

    @classmethod
    def search_space(cls):
        return {"step_size": Space.choice(0.05, 0.1, 0.2, 0.3)}  # ours: the paper's d is [U], the code's 0.2


# ----------------------------------------------------------------------------- the equations

def step_size(d: float, rnd: int, rounds: int, num_clients: int) -> float:
    """d_r = (d - (r - 2) d / R) / N for the gaps measured on theta^r (r 1-based). The official loop
    counts its rounds i from 0 and, after round i, steps by d - (i - 1) d / R, one third of it
    (its three sources; 1/N here): with i = r - 1 that is d - (r - 2) d / R. d = 0.2, R = 15, N = 4:
    r = 1 gives (0.2 + 0.2/15) / 4 = 0.05333, r = 2 gives 0.05, r = 14 gives (0.2 - 0.16) / 4 = 0.01."""
    return (d - (rnd - 2) * d / rounds) / num_clients


def adjust_weights(weights: dict[int, float], gaps: dict[int, float], step: float, metric: str = "acc",
                   centre: bool = False) -> dict[int, float]:
    """a_k <- clip(a_k + s step G_k / max_j |G_j|, 0, 1) for the clients with a gap, then all the
    weights renormalised to sum 1. a = (1/3, 1/3, 1/3), accuracy gaps (-0.1, -0.2, 0), step 0.2/3:
    G^ = (-0.5, -1, 0), a + (1/30, 2/30, 0) = (11/30, 12/30, 10/30), / (33/30) = (1/3, 4/11, 10/33)."""
    if not gaps:
        return dict(weights)
    g = {k: float(v) for k, v in gaps.items()}
    if centre:
        mean = sum(g.values()) / len(g)
        g = {k: v - mean for k, v in g.items()}
    scale = max(abs(v) for v in g.values())
    if scale == 0:  # every gap 0: nothing to normalise by
        return dict(weights)
    sign = 1.0 if metric == "loss" else -1.0
    new = {k: min(max(a + sign * step * g[k] / scale, 0.0), 1.0) if k in g else a for k, a in weights.items()}
    total = sum(new.values())
    return {k: a / total for k, a in new.items()} if total > 0 else dict(weights)


def validation_metric(model, split, batch_size: int, device, metric: str) -> float | None:
    """Accuracy or mean loss of ``model`` on a split; None for an empty split."""
    r = evaluate(model, split, batch_size, device)
    if not r["n"]:
        return None
    return r["correct"] / r["n"] if metric == "acc" else r["loss_sum"] / r["n"]


class FedDGGA(Method):
    name = "feddg_ga"
    Hparams = FedDGGAHparams
    paper = "Zhang, Xu, Yao, Zhang, Tian, Wang, CVPR 2023"
    shares = 'shares the whole model; server adjusts aggregation weights by generalization gaps'
    aggregator = KeepAll()  # the weights a_k are known only once the round's gaps are in

    def init_server(self, model):
        return {**super().init_server(model), "weights": {}}  # a_k = 1/N, filled in as clients appear

    def init_client_state(self, client_id, model):
        return {}  # m_k^before and its round, after the client's first round

    def local_update(self, ctx: ClientContext) -> Upload:
        model, metric = ctx.model, self.hp.metric
        bs = max(ctx.train.batch_size, 256)
        extras = {}
        before = ctx.state.get("before")
        if before is not None and ctx.state.get("round") == ctx.round - 1:
            after = validation_metric(model, ctx.data.val, bs, ctx.device, metric)  # theta^{r-1} as received
            if after is not None:
                extras["gap"] = after - before
        stats = train_epochs(ctx)
        mine = validation_metric(model, ctx.data.val, bs, ctx.device, metric)  # theta_k
        ctx.state.clear()
        if mine is not None:
            ctx.state.update(before=mine, round=ctx.round)
        if "gap" in extras:
            stats["ga_gap"] = extras["gap"]  # m^after(theta^{r-1}) - m^before(theta_k^{r-1})
        up = self.upload(ctx, stats)
        up.extras = extras
        return up

    def aggregate(self, state, uploads, round):
        n = self.setup.num_clients
        weights = {**{k: 1.0 / n for k in uploads.each}, **state["weights"]}
        gaps = {k: u.extras["gap"] for k, u in uploads.each.items() if "gap" in u.extras}
        step = step_size(self.hp.step_size, round - 1, self.setup.rounds, n)
        weights = adjust_weights(weights, gaps, step, self.hp.metric, self.hp.centre)
        mine = {k: weights[k] for k in uploads.each}
        if sum(mine.values()) <= 0:  # every client of the round clipped to 0: average them uniformly
            mine = {k: 1.0 for k in mine}
        glob = weighted_mean(((u.tensors, mine[k]) for k, u in uploads.each.items()), like=state["global"])
        return {**state, "global": {**state["global"], **glob}, "weights": weights}

    def server_metrics(self, state):
        return {f"weight_{k}": float(a) for k, a in state["weights"].items()}
