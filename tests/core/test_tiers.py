"""Which capability tier a client has (raysim.core.tiers.ClientTiers): the one assignment DapperFL,
FedDrop, FedMP and NeFL share, by hand."""
from types import SimpleNamespace

import pytest

from raysim.core.errors import UserError
from raysim.core.tiers import ClientTiers, level_tiers


def setup(num_clients, profiles=(), seed=0):
    return SimpleNamespace(num_clients=num_clients, client_profiles=profiles, seed=seed)


def test_without_profiles_equal_shares_deal_k_mod_l_and_shares_follow_level_tiers():
    tiers = ClientTiers(setup(7), 3, method="m")
    assert [tiers(k) for k in range(9)] == [0, 1, 2, 0, 1, 2, 0, 1, 2]  # k mod 3, beyond the 7 clients too
    # shares 3 : 1 over 8 clients: 6 and 2 slots, the cycle skipping level 1 once it is full
    shared = ClientTiers(setup(8), 2, method="m", shares=(3, 1))
    assert [shared(k) for k in range(10)] == [0, 1, 0, 1, 0, 0, 0, 0, 0, 1]  # then k mod 2
    seeded = ClientTiers(setup(8, seed=4), 2, method="m", how="random", purpose="p")
    assert [seeded(k) for k in range(8)] == level_tiers(8, 2, None, "random", 4, "p").tolist()


def test_a_profile_gives_its_tier_and_one_beyond_the_levels_is_one_line():
    profiles = ({"tier": 2}, {"tier": 0}, {"tier": 3})  # tiers 0..2 exist
    tiers = ClientTiers(setup(4, profiles), 3, method="fedmp")
    assert [tiers(0), tiers(1), tiers(3)] == [2, 0, 0]  # client 3 has no profile: 3 mod 3
    with pytest.raises(UserError, match=r"^fedmp: client 2 has tier 3 but hp.fedmp.rho_levels lists 3 levels"):
        tiers(2)
    assert ClientTiers(setup(4, profiles), 3, method="dapperfl", checked=False)(2) == 3
