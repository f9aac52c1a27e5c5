"""FSDP2 (``fully_shard``) traced into the graph, or refused by name.

- :mod:`.hooks`: the pre- and post-forward hooks of one FSDP2 module, traced;
- :mod:`.groups`: the hooks of a module group (``fully_shard([norm, output])``);
- :mod:`.reduce`: FSDP2's gradient reduction as the backward of the traced all-gather;
- :mod:`.passes`: the traced hooks' own bookkeeping of a forward pass (not FSDP2's, which eager code leaves mid-pass);
- :mod:`.sources`: module paths of modules reached through an FSDP2 state (read by the audit);
- :mod:`.eager`: where FSDP2's eager hooks would meet compiled code (``torch.compile(fsdp_module)``,
  compiled autograd).
"""
