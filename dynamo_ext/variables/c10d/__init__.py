"""``torch.distributed`` (c10d) traced: process groups, ``ReduceOp``, queries, collectives and P2P.

- trackers: :mod:`.process_group` (``ProcessGroup``, ``dist.group``), :mod:`.reduce_op` (``ReduceOp`` members);
- polyfills written with functional collectives: :mod:`.collectives` (all-reduce, all-gather, reduce-scatter,
  all-to-all), :mod:`.rooted` (broadcast, reduce, scatter, gather, barrier), :mod:`.p2p`, :mod:`.nn_functional`
  (``torch.distributed.nn.functional`` with eager's autograd), and what they return for ``async_op=True``
  (:mod:`.work`);
- trace-time helpers: :mod:`.args` (groups, ranks, reduce ops folded to constants), :mod:`.queries`
  (``get_rank`` ...), :mod:`.breaks` (named graph breaks for what cannot be traced);
- :mod:`.handlers`: the table that registers each polyfill in place of its ``torch.distributed`` function.
"""
