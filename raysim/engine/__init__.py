"""The engine layer: one federation's round loop on Ray actors (or in process).

Server and client hosts, the client state store, the simulated clock and compute meter,
metrics and checkpoints. Imports core, config, data, models, and methods through
``raysim.methods.registry`` only; never names a method and never imports ``raysim.app``."""
