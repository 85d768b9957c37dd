"""ε of raysim's accountant against pfl-research's for the same DP-FedAvg parameters.

pfl-research (Apple) accounts central DP with Poisson sampling of the cohort
(``pfl.privacy.PLDPrivacyAccountant`` and ``RDPPrivacyAccountant``: sampling probability q, the
noise multiplier z, the number of compositions T, δ). This script runs in pfl's side venv
(``benchmarks/.venv-pfl``, made by ``benchmarks/pfl_env.py``), asks pfl for ε, and raysim's
``Accounting`` (raysim is installed there with --no-deps; dp-accounting is pfl's own pin) for the
same (N, m = qN, z, T, δ), and prints both, and pfl's noise multiplier for a target ε beside
raysim's. Run:

    python -m benchmarks.dp_crosscheck            # builds the venv on first use, then runs in it
"""
from __future__ import annotations

import os
import subprocess
import sys

CASES = [  # (N, m, z, T, δ): the privacy table's workload (N 100, m 10, 100 rounds, δ 1/N) and a larger one
    (100, 10, 1.0, 100, 0.01),
    (100, 10, 2.0, 100, 0.01),
    (1000, 10, 0.8, 200, 1e-3),
    (10000, 100, 1.2, 500, 1e-4),
]
TARGETS = [(100, 10, 100, 0.01, 8.0), (100, 10, 100, 0.01, 4.0), (100, 10, 100, 0.01, 1.0)]


def inside() -> None:
    import warnings
    warnings.simplefilter("ignore")
    from importlib.metadata import version
    from pfl.privacy import PLDPrivacyAccountant, RDPPrivacyAccountant
    from raysim.core.privacy import Accounting
    print(f"pfl {version('pfl')}, dp-accounting {version('dp-accounting')}")
    print("| N | m | z | T | δ | pfl PLD ε | raysim PLD ε | pfl RDP ε | raysim RDP ε |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, m, z, t, delta in CASES:
        q = m / n
        pfl_pld = PLDPrivacyAccountant(num_compositions=t, sampling_probability=q, mechanism="gaussian",
                                       noise_parameter=z, delta=delta).epsilon
        pfl_rdp = RDPPrivacyAccountant(num_compositions=t, sampling_probability=q, mechanism="gaussian",
                                       noise_parameter=z, delta=delta).epsilon
        ours_pld = Accounting("poisson", n, m, "pld").epsilon(z, t, delta)
        ours_rdp = Accounting("poisson", n, m, "rdp").epsilon(z, t, delta)
        print(f"| {n} | {m} | {z} | {t} | {delta:g} | {pfl_pld:.6f} | {ours_pld:.6f} | {pfl_rdp:.6f} | {ours_rdp:.6f} |")
    print()
    print("| N | m | T | δ | target ε | pfl RDP z | raysim RDP z | raysim's z: ε |")
    print("|---|---|---|---|---|---|---|---|")
    for n, m, t, delta, eps in TARGETS:
        pfl_z = RDPPrivacyAccountant(num_compositions=t, sampling_probability=m / n, mechanism="gaussian",
                                     epsilon=eps, delta=delta).noise_parameter
        a = Accounting("poisson", n, m, "rdp")
        z = a.noise_for(eps, t, delta)
        print(f"| {n} | {m} | {t} | {delta:g} | {eps:g} | {pfl_z:.4f} | {z:.4f} | {a.epsilon(z, t, delta):.4f} |")


def main() -> None:
    if os.environ.get("RAYSIM_DP_CROSSCHECK_INSIDE"):
        inside()
        return
    from benchmarks import pfl_env
    python, why = pfl_env.ensure()
    if python is None:
        sys.exit(f"pfl-research's venv is not available: {why}")
    env = {**os.environ, "RAYSIM_DP_CROSSCHECK_INSIDE": "1"}
    sys.exit(subprocess.call([python, "-m", "benchmarks.dp_crosscheck"], env=env,
                             cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


if __name__ == "__main__":
    main()
