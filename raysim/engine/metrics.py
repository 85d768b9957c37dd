"""Metrics in long format: one row per (round, client, domain, split, metric, value).

``client`` is -1 for federation-level rows: per-domain pooled accuracy; ``AVG``, the mean over
domains of those pooled accuracies (the papers' AVG, "the average accuracy across all domains");
``ALL``, the accuracy over every client's pooled samples (the papers' ALL); ``AVG_clients``, the
plain mean of the clients' accuracies (equal to AVG with one client per domain and a shared test
set, not otherwise); ``AVG_weighted``, the clients' accuracies weighted by their training-set sizes
(FDSE's code selects its reported round by this on the validation split). Communication and
training loss are federation-level rows too.

metrics.parquet records the fingerprint of the config that wrote it in its schema's metadata
(:data:`CONFIG_KEY`; no column changes), so a folder's metrics say which config they are of.
"""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from raysim.core.files import write_atomically
from raysim.engine.checkpoint import config_fingerprint
from raysim.engine.messages import RoundSummary, SplitScores

COLUMNS = ("round", "client", "domain", "split", "metric", "value")
SCHEMA = pa.schema([("round", pa.int32()), ("client", pa.int64()), ("domain", pa.string()),
                    ("split", pa.string()), ("metric", pa.string()), ("value", pa.float64())])
MAX_BATCHES = 32  # MetricsLog.table's Arrow chunks before they are merged into one
CONFIG_KEY = b"raysim.config"  # the schema metadata key of the config's fingerprint (checkpoint.config_fingerprint)


class MetricsLog:
    """The federation's rows, appended to Python lists and converted to Arrow once each: :meth:`table`
    converts only the rows added since its last call, so writing metrics.parquet after every
    evaluated round (and each checkpoint's copy) costs the new rows' conversion, not the whole log's
    again (about 0.3 s a write at a million rows, a long run's every evaluation)."""

    def __init__(self):
        self._cols: dict[str, list] = {c: [] for c in COLUMNS}
        self._batches: list[pa.RecordBatch] = []  # rows [0, self._converted) as Arrow
        self._converted = 0

    @classmethod
    def from_table(cls, table: pa.Table) -> "MetricsLog":
        log = cls()
        for c in COLUMNS:
            log._cols[c] = table.column(c).to_pylist()
        return log

    def add(self, rnd: int, client: int, domain: str, split: str, metric: str, value: float) -> None:
        for c, v in zip(COLUMNS, (rnd, client, domain, split, metric, float(value))):
            self._cols[c].append(v)

    def __len__(self) -> int:
        return len(self._cols["round"])

    def table(self) -> pa.Table:
        n = len(self)
        if n > self._converted:
            self._batches.append(pa.RecordBatch.from_pydict({c: self._cols[c][self._converted:n] for c in COLUMNS},
                                                            schema=SCHEMA))
            self._converted = n
            if len(self._batches) > MAX_BATCHES:  # one batch again: a long run's writes stay few chunks
                self._batches = pa.Table.from_batches(self._batches, schema=SCHEMA).combine_chunks().to_batches()
        return pa.Table.from_batches(self._batches, schema=SCHEMA)

    def last_round(self) -> int:
        """The last round with rows (0 if none): a resumed federation's starting point."""
        return int(max(self._cols["round"], default=0))

    def last_value(self, split: str, metric: str, up_to: int) -> float | None:
        """The federation row (``client`` −1) ``split``/``metric`` of the last round ≤ ``up_to`` that
        has one (a resumed run's simulated time); None if none does."""
        cols = self._cols
        for i in range(len(cols["round"]) - 1, -1, -1):
            if (cols["round"][i] <= up_to and cols["client"][i] == -1 and cols["split"][i] == split
                    and cols["metric"][i] == metric):
                return cols["value"][i]
        return None

    def round_rows(self, rnd: int) -> list[tuple]:
        """(round, client, domain, split, metric, value) of round ``rnd``, whose rows the round loop
        adds last: the log's tail, so this costs the round's rows, not the log's."""
        rounds = self._cols["round"]
        i = len(rounds)
        while i > 0 and rounds[i - 1] == rnd:
            i -= 1
        return list(zip(*(self._cols[c][i:] for c in COLUMNS)))

    def write(self, path: str, config: str | None = None) -> None:
        """Atomically (:func:`~raysim.core.files.write_atomically`): a failed write leaves the
        previous file as it was (and no ``.tmp``); its error is a one-line WriteFailed naming the file.
        ``config``: the fingerprint of the config that wrote the rows, kept in the schema's metadata."""
        table = self.table()
        if config is not None:
            table = table.replace_schema_metadata({CONFIG_KEY: config.encode()})
        write_atomically(path, lambda tmp: pq.write_table(table, tmp))

    # ------------------------------------------------------------------ rows from results
    def add_round(self, rnd: int, summary: RoundSummary, domain_of=None) -> None:
        """Training rows: every numeric client metric (loss, a method's diagnostics, footprints),
        their mean over the round's clients, and the round's communication."""
        per_client = summary.client_metrics
        names = sorted({k for m in per_client.values() for k, v in m.items() if _is_number(v)})
        for name in names:
            values = []
            for cid in sorted(per_client):
                v = per_client[cid].get(name)
                if _is_number(v):
                    values.append(float(v))
                    if domain_of is not None:
                        self.add(rnd, cid, domain_of(cid), "train", name, v)
            self.add(rnd, -1, "ALL", "train", name, float(np.mean(values)))
        if "loss" not in names:
            self.add(rnd, -1, "ALL", "train", "loss", summary.train_loss)
        self.add(rnd, -1, "ALL", "comm", "bytes_up", summary.bytes_up)
        self.add(rnd, -1, "ALL", "comm", "bytes_down", summary.bytes_down)
        for name, value in (summary.clock or {}).items():  # the simulated clock (client profiles)
            self.add(rnd, -1, "ALL", "clock", name, value)
        for name, value in (summary.server_metrics or {}).items():
            self.add(rnd, -1, "ALL", "server", name, value)
        if summary.bytes_up_eval:  # personal tensors gathered only to build the global model
            self.add(rnd, -1, "ALL", "comm", "bytes_up_eval", summary.bytes_up_eval)

    def add_eval(self, rnd: int, results: dict[int, dict[str, SplitScores]], domain_of) -> dict:
        """Per-client rows, then per-domain and AVG/ALL/AVG_clients/AVG_weighted rows, from the
        hosts' ``results[client][split]``. Returns {split: {"AVG": ..., "ALL": ..., "AVG_clients": ...}}."""
        headline = {}
        splits = sorted({s for r in results.values() for s in r})
        for split in splits:
            pooled: dict[str, np.ndarray] = {}  # domain -> [correct, loss_sum, n]
            client_acc, train_sizes = [], []
            for cid in sorted(results):
                r = results[cid].get(split)
                if r is None or r.num_samples == 0:
                    continue
                dom = domain_of(cid)
                acc, loss = r.correct / r.num_samples, r.loss_sum / r.num_samples
                self.add(rnd, cid, dom, split, "accuracy", acc)
                self.add(rnd, cid, dom, split, "loss", loss)
                client_acc.append(acc)
                train_sizes.append(float(r.num_train))
                pooled.setdefault(dom, np.zeros(3))
                pooled[dom] += (r.correct, r.loss_sum, r.num_samples)
            domain_acc = []
            for dom in pooled:  # clients are numbered domain by domain: the dataset's order
                c, ls, n = pooled[dom]
                domain_acc.append(c / n)
                self.add(rnd, -1, dom, split, "accuracy", c / n)
                self.add(rnd, -1, dom, split, "loss", ls / n)
            if client_acc:
                total = sum(pooled.values())
                avg, all_ = float(np.mean(domain_acc)), total[0] / total[2]
                avg_clients = float(np.mean(client_acc))
                w = np.asarray(train_sizes)
                avg_weighted = float(np.dot(w, client_acc) / w.sum()) if w.sum() > 0 else avg_clients
                self.add(rnd, -1, "AVG", split, "accuracy", avg)
                self.add(rnd, -1, "ALL", split, "accuracy", all_)
                self.add(rnd, -1, "ALL", split, "loss", total[1] / total[2])
                self.add(rnd, -1, "AVG_clients", split, "accuracy", avg_clients)
                self.add(rnd, -1, "AVG_weighted", split, "accuracy", avg_weighted)
                headline[split] = {"AVG": avg, "ALL": all_, "AVG_clients": avg_clients}
        return headline


class MetricsWriter:
    """Round-loop callback: ``metrics.parquet`` after every evaluated round (an early-stopped or
    killed run keeps its rows so far) and when the loop ends, marked with ``cfg``'s fingerprint."""

    def __init__(self, run_dir: str, cfg):
        self.path = os.path.join(run_dir, "metrics.parquet")
        self.config = config_fingerprint(cfg)

    def on_start(self, run) -> None:
        pass

    def on_round(self, rnd: int, summary: RoundSummary, evaluation, log: MetricsLog) -> None:
        if evaluation is not None:
            log.write(self.path, self.config)

    def on_end(self, log: MetricsLog) -> None:
        if len(log):
            log.write(self.path, self.config)


def _is_number(v) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool)


def read(path: str):
    """metrics.parquet as a pandas DataFrame."""
    return pq.read_table(path).to_pandas()


def recorded_config(path: str) -> str | None:
    """The config fingerprint a metrics.parquet records; None for one written before metrics
    carried it, or one too damaged to read."""
    try:
        metadata = pq.read_schema(path).metadata or {}
    except Exception:  # a truncated or corrupted file
        return None
    config = metadata.get(CONFIG_KEY)
    return config.decode("utf-8", "replace") if config is not None else None
