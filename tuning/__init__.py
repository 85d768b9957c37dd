"""Hyperparameter search for raysim methods: Ray Tune runs whole federations as trials (one
placement group each), Optuna samples them, a Tune scheduler stops bad ones early.

    raysim tune configs/tune/fdse.yaml trials=4 rounds=3

Modules: ``spec`` (the tune config), ``space`` (search spaces, Optuna form), ``trial`` (the
trainable and its resources), ``search`` (the Tuner, resume, ``main``), ``outputs``
(trials.parquet, best.yaml, search.png). The config format is in tuning/README.md.
"""
