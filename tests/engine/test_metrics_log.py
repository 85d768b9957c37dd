"""MetricsLog converts each row to Arrow once (``table`` appends only the rows added since its
last call): whatever the pattern of adds, tables and writes, what it returns and writes is the
whole log, row for row, as a fresh conversion of every row would give."""
import pyarrow as pa
import pyarrow.parquet as pq

from raysim.engine import metrics
from raysim.engine.metrics import SCHEMA, MetricsLog


def _fresh(log: MetricsLog) -> pa.Table:
    return pa.table({c: list(v) for c, v in log._cols.items()}, schema=SCHEMA)


def test_tables_between_adds_are_the_whole_log_and_their_chunks_are_merged(tmp_path, monkeypatch):
    monkeypatch.setattr(metrics, "MAX_BATCHES", 3)
    log = MetricsLog()
    assert log.table().num_rows == 0
    for rnd in range(1, 12):
        for client in range(-1, rnd % 4):
            log.add(rnd, client, "mnist" if client >= 0 else "ALL", "train", "loss", rnd + client / 10)
        if rnd % 2:  # a table (an evaluated round's write) every other round; two in a row change nothing
            assert log.table().equals(_fresh(log))
            assert log.table().equals(_fresh(log))
            assert log.table().num_rows == len(log)
        assert len(log._batches) <= 4  # merged into one past MAX_BATCHES
    path = tmp_path / "metrics.parquet"
    log.write(str(path), "fingerprint")
    written = pq.read_table(path)
    assert written.schema.metadata == {metrics.CONFIG_KEY: b"fingerprint"}
    assert written.replace_schema_metadata(None).equals(_fresh(log))


def test_a_log_read_back_from_a_table_goes_on_where_it_was():
    log = MetricsLog()
    log.add(1, -1, "ALL", "train", "loss", 0.5)
    log.table()
    again = MetricsLog.from_table(log.table())
    again.add(2, 3, "usps", "test", "accuracy", 0.25)
    assert again.table().equals(_fresh(again))
    assert again.table().num_rows == 2 and again.last_round() == 2
