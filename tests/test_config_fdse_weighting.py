"""FDSE Table 1 configs: Ditto and LG-FedAvg average uniformly, as FLGo's Ditto and LG-FedAvg's
official code do (baselines spec 3.1 pitfall 3, 3.2 pitfall 3); the other methods keep n_k."""
from pathlib import Path

import pytest

from raysim.config import load_config

CONFIGS = Path(__file__).parents[1] / "configs" / "fdse"


@pytest.mark.parametrize("name", ["office_caltech10", "pacs", "domainnet"])
def test_fdse_table1_ditto_and_lg_fedavg_average_uniformly(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    # what a run of each method sees: the config narrowed to it, per_method merged in (raysim.app.experiment)
    assert cfg.for_method("ditto").train.weighting == "uniform"
    assert cfg.for_method("lg_fedavg").train.weighting == "uniform"
    assert cfg.for_method("fedavg").train.weighting == "samples"
    assert cfg.for_method("fdse").train.weighting == "samples"
    if name == "pacs":  # merged with the settings per_method held before: the official PACS lr
        assert cfg.for_method("ditto").train.lr == 0.05 and cfg.for_method("fdse").train.lr == 0.05
        assert cfg.for_method("lg_fedavg").train.lr == 0.1
