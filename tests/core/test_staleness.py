"""Staleness weights by hand."""
import math

import pytest

from raysim.core.staleness import Staleness


def test_fedbuffs_weight_is_one_over_root_one_plus_tau():
    s = Staleness("sqrt")
    assert [s.weight(t) for t in (0, 3, 8)] == [1.0, 0.5, pytest.approx(1 / 3)]


def test_fedasyncs_three_weightings_by_hand():
    assert [Staleness("constant").weight(t) for t in (0, 7)] == [1.0, 1.0]
    poly = Staleness("polynomial", a=0.5)
    assert [poly.weight(t) for t in (0, 3, 15)] == [1.0, 0.5, 0.25]
    hinge = Staleness("hinge", a=10, b=4)
    # 1 up to b = 4 steps, then 1 / (10 (τ − 4) + 1): τ = 5 -> 1/11, τ = 6 -> 1/21
    assert [hinge.weight(t) for t in (0, 4, 5, 6)] == [1.0, 1.0, pytest.approx(1 / 11), pytest.approx(1 / 21)]


def test_unknown_kind_and_negative_staleness_are_refused():
    with pytest.raises(ValueError, match="expected one of sqrt, constant, polynomial, hinge"):
        Staleness("linear")
    with pytest.raises(ValueError, match="< 0"):
        Staleness().weight(-1)
    assert math.isclose(Staleness("polynomial", a=1.0).weight(1), 0.5)
