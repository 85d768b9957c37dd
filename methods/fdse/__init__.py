"""FDSE (Wang et al., CVPR 2025): the method, its layer decomposition, its regularizer and its
server step, one module each."""
from raysim.methods.fdse.aggregation import (consensus_update, min_norm_simplex, similarity_attention,
                                            similarity_mix)
from raysim.methods.fdse.consistency import ConsistencyRegularizer, batch_stats, consistency_term, layer_weights
from raysim.methods.fdse.method import FDSE, FDSEHparams, key_role

__all__ = ["FDSE", "FDSEHparams", "key_role", "ConsistencyRegularizer", "batch_stats", "consistency_term",
           "layer_weights", "consensus_update", "min_norm_simplex", "similarity_attention", "similarity_mix"]
