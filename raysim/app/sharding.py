"""``raysim data shard``: cut a config's federation(s) into shards that hosts read directly
(``data.shards``; the format is :mod:`raysim.data.shards`, reading it :mod:`raysim.engine.datashards`)."""
from __future__ import annotations

import dataclasses
import json
import posixpath

from raysim.app.rundir import lodo_holdouts, with_holdout
from raysim.core.files import write_bytes
from raysim.data.shards import resolve_uri, write_shards
from raysim.engine.datashards import FORMAT_VERSION, INDEX_FILE, fingerprint, holdout_dir


def federation_holdouts(cfg) -> list[str] | None:
    """The held-out domains the config's runs use: every LODO federation, or the partition's own."""
    if cfg.eval.protocol == "lodo":
        return lodo_holdouts(cfg)
    holdout = dict(cfg.data.partition).get("holdout")
    return None if holdout is None else [holdout]


def write_federation_shards(cfg, uri: str, image_format: str = "raw", clients_per_file: int = 1,
                            echo=None) -> dict:
    """Cut ``cfg``'s partition(s) and write them under ``uri``; returns the index written.

    Reads the dataset the ordinary way (``data.root``, ``data.options``); ``cfg.data.shards`` is
    ignored. Leave-one-domain-out configs get one source/target pair per held-out domain.
    """
    from raysim.engine.federation import Federation

    fs, root = resolve_uri(uri, None)  # a bad URI fails before the dataset is loaded
    plain = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, shards=None))
    fed = Federation(plain)
    ds = fed.dataset
    fs.create_dir(root, recursive=True)
    fp = fingerprint(cfg)
    holdouts = federation_holdouts(plain)
    say = echo or (lambda text: None)
    if holdouts is None:
        write_shards(ds, fed.partition, root, fs, image_format, clients_per_file, config=fp)
        say(f"{fed.partition.num_clients} clients -> {root}")
    else:
        for h in holdouts:
            f = Federation(with_holdout(plain, h), dataset=ds)
            for role, part in (("source", f.partition), ("target", f.target)):
                path = holdout_dir(root, h, role)
                write_shards(ds, part, path, fs, image_format, clients_per_file, config={**fp, "holdout": h})
                say(f"holdout {h}: {part.num_clients} {role} client(s) -> {path}")
    index = {"format_version": FORMAT_VERSION, "config": fp, "domains": list(ds.domains),
             "classes": list(ds.classes), "holdouts": holdouts}
    # last: marks the folder complete
    write_bytes(posixpath.join(root, INDEX_FILE), json.dumps(index, indent=1).encode(), filesystem=fs)
    return index
