"""Inductor lowerings and post-grad passes that fuse collectives with their neighbours.

``install(patches)`` (called by :func:`dynamo_ext.install`) defines our two custom
ops, registers their lowerings in Inductor's ``lowerings`` table, and appends four
post-grad passes after any the user set in
``torch._inductor.config.post_grad_custom_post_pass``:

1. :class:`~.rms_norm_fusion.ResidualRMSNormPass`: all-reduce + residual add +
   RMSNorm (NOTE [residual rms norm chain]);
2. :class:`~.bucketing.AllReduceBucketingPass`: independent small all-reduces,
   and FSDP-style dim-0 all-gathers and reduce-scatters, merged per group,
   dtype (and reduce op) into one collective each bucket (NOTE [all-reduce
   bucketing order], NOTE [all-gather / reduce-scatter buckets]), never across
   other communication (NOTE [buckets keep the communication order]);
3. :class:`~.comm_order.CommunicationOrderPass`: ordering dependencies that keep
   the program's communication order under Inductor's scheduling passes, where
   a graph holds point-to-point ops or our own communication ops (NOTE
   [communication order under Inductor's passes]);
4. :class:`~.subgraph_outputs.SubgraphOutputCopyPass`: an ``invoke_subgraph``
   body returns no input of its own, so Inductor cannot overwrite a saved
   activation (NOTE [subgraph outputs that alias inputs]).

Every change goes through ``patches`` so ``dynamo_ext.uninstall()`` undoes it.
Thresholds and switches live in :mod:`.options` (a torch config module: ``options.patch(...)``).
"""

from __future__ import annotations

from .. import _compat
from .._patching import Patcher


def install(patches: Patcher) -> None:
    """Define the ops, register the lowerings, append the post-grad passes.

    Does nothing on a torch build without functional collectives (nothing to fuse).
    """
    if not _compat.has_functional_collectives():
        return
    from . import bucket_op, bucketing, comm_order, ops, rms_norm_fusion, rms_norm_lowering, subgraph_outputs
    from .registry import append_post_grad_passes, install_lowerings

    patches.on_undo(_compat.forget_symm_mem_groups)  # NOTE [symmetric memory route]
    ops.define_ops(patches)
    bucket_op.define(patches)  # NOTE [buckets only where ranks agree]
    install_lowerings(patches, rms_norm_lowering.rules())
    append_post_grad_passes(
        patches,
        [
            rms_norm_fusion.ResidualRMSNormPass(),
            bucketing.AllReduceBucketingPass(),
            comm_order.CommunicationOrderPass(),  # NOTE [communication order under Inductor's passes]
            subgraph_outputs.SubgraphOutputCopyPass(),  # NOTE [subgraph outputs that alias inputs]
        ],
    )
