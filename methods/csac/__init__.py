"""CSAC (Yuan et al., IEEE TKDE 2023): the method and its calibration pieces."""
from raysim.methods.csac.calibration import (FeatureTaps, Projections, attention_scores, attention_weights,
                                             default_layers, mk_mmd, mk_mmd_pairs, mse_discrepancy, projection_conv)
from raysim.methods.csac.method import CSAC, CSACHparams, fuse, fusion_weights, tensor_distances

__all__ = ["CSAC", "CSACHparams", "fuse", "fusion_weights", "tensor_distances", "FeatureTaps", "Projections",
           "attention_scores", "attention_weights", "default_layers", "mk_mmd", "mk_mmd_pairs", "mse_discrepancy",
           "projection_conv"]
