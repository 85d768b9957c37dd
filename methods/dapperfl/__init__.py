"""DapperFL (Jia et al., NeurIPS 2024): the method, its masks and its footprint report."""
from raysim.methods.dapperfl.footprint import (PAPER_LEVELS, footprint_from_run, footprint_markdown, footprint_table,
                                               measure_footprint)
from raysim.methods.dapperfl.masks import layer_roles, prune_masks
from raysim.methods.dapperfl.method import (DapperFL, DapperFLHparams, RepresentationTap, dar_term, fuse,
                                            fusion_factor, local_objective, recover)

__all__ = ["DapperFL", "DapperFLHparams", "RepresentationTap", "dar_term", "fuse", "fusion_factor",
           "local_objective", "recover", "layer_roles", "prune_masks",
           "PAPER_LEVELS", "footprint_from_run", "footprint_markdown", "footprint_table", "measure_footprint"]
