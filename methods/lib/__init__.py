"""The shared method library: what several methods are built from, and no method itself (the
registry names none of it).

* :mod:`.masks`      how many channels a ratio prunes, the top-k mask, w <- w * M (DapperFL, FedMP,
                     FedDrop, NeFL);
* :mod:`.channels`   channel sub-models of a dense network: channel groups, plans, slicing
                     (FedDrop, FedMP, NeFL);
* :mod:`.submodels`  their server side (residual recovery, the holders' mean), their footprints and
                     the client step they share (:class:`~.submodels.SubModelMethod`).

Which capability tier a client has is the engine's and every method's: :class:`raysim.core.tiers.ClientTiers`.
"""
