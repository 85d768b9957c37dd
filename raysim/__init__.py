"""raysim: a Ray-based simulator for federated learning under domain shift."""
__version__ = "0.1.0"
