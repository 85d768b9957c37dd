"""The core layer: what every other layer builds on and that imports nothing of raysim above it.

Errors, typed settings and hyperparameters, tensor dicts, keyed seeding, aggregation, the method
contract, training primitives, device tiers, and file writes (one atomic-write helper)."""
