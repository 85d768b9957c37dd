"""A host's evaluation of its clients under the three protocols (``eval.protocol``), and an unseen
client's label-free adaptation before it is evaluated.

* ``personalized``: each client with its own model (as it left training with ``eval.point:
  post_train``, else the method's ``eval_model`` of the payload and its state);
* ``global``: every client with the method's global model;
* ``lodo``: as global, and each unseen client (a held-out domain's) with the global model after
  ``Method.adapt_to_unseen`` on its data, and before it as split ``<split>_unadapted``.
"""
from __future__ import annotations

from raysim.core.contract import UnseenClient
from raysim.core.seeding import generator_for
from raysim.core.training import evaluate
from raysim.engine.messages import SplitScores, client_payload
from raysim.models.dropout import dropout_generator


class Evaluator:
    """Scores a host's clients with the host's one model instance (the method builds each client's
    model into it) and the host's client data."""

    def __init__(self, cfg, fed, model, initial_state: dict, data, device, record_of):
        """``initial_state``: the model's initial weights; ``data``: client id -> ClientViews;
        ``record_of(client id)``: the client's stored record (its initial one if it has none)."""
        self.cfg, self.fed, self.method = cfg, fed, fed.method
        self.model, self.initial_state, self.data, self.device = model, initial_state, data, device
        self.record_of = record_of

    def run(self, rnd: int, payload: dict, requests: dict[int, list[str]], protocol: str,
            personal_boxes: dict) -> dict[int, dict[str, SplitScores]]:
        """The scores of each requested (client, split) at round ``rnd``; ``payload`` is the
        evaluation payload, on the host's device."""
        out = {}
        if protocol == "personalized":
            for cid in sorted(requests):
                record = self.record_of(cid)
                if "trained" in record:  # eval.point post_train
                    self.model.load_state_dict(record["trained"])
                    model = self.model
                else:  # "received", and clients not trained yet
                    mine = client_payload(payload, personal_boxes.get(cid), self.device)
                    model = self.method.eval_model(self.model, mine, record["state"])
                out[cid] = self.scores(model, cid, requests[cid])
            return out
        seen = [c for c in sorted(requests) if not self.fed.is_unseen(c)]
        if seen:
            model = self.global_model(payload)
            for cid in seen:
                out[cid] = self.scores(model, cid, requests[cid])
        for cid in sorted(set(requests) - set(seen)):
            model = self.global_model(payload)  # afresh: adaptation changes it
            before = self.scores(model, cid, requests[cid])
            with dropout_generator(generator_for(self.cfg.seed, rnd, cid, "adapt_dropout", self.device)):
                adapted = self.cfg.eval.adapt and self.method.adapt_to_unseen(model, self.unseen_client(cid, rnd))
            if adapted:
                out[cid] = {**self.scores(model, cid, requests[cid]),
                            **{f"{split}_unadapted": r for split, r in before.items()}}
            else:
                out[cid] = before
        return out

    def global_model(self, payload: dict):
        """The method's global model, built on the initial weights (so tensors nothing sets are
        defined, and nothing of the last client's state leaks in)."""
        self.model.load_state_dict(self.initial_state)
        return self.method.global_eval_model(self.model, payload)

    def unseen_client(self, cid: int, rnd: int) -> UnseenClient:
        """What ``Method.adapt_to_unseen`` sees of an unseen client in round ``rnd``."""
        train = self.cfg.train
        return UnseenClient(client_id=cid, domain=self.fed.domain(cid), round=rnd, data=self.data[cid].for_method(),
                            train=train, lr=train.lr * train.lr_decay ** (rnd - 1),
                            generator=generator_for(self.cfg.seed, rnd, cid, "adapt"), device=self.device)

    def scores(self, model, cid: int, splits: list[str]) -> dict[str, SplitScores]:
        bs = max(self.cfg.train.batch_size, 256)
        data = self.data[cid]
        out = {}
        for s in splits:
            r = evaluate(model, getattr(data, s), bs, self.device)
            out[s] = SplitScores(correct=r["correct"], loss_sum=r["loss_sum"], num_samples=r["n"],
                                 num_train=data.num_train)
        return out
