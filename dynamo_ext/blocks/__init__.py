"""Repeated blocks (the items of ``nn.ModuleList`` of transformer layers) compiled once inside the one graph.

- :mod:`.split`: the graph Dynamo hands to ``inductor`` or an AOTAutograd backend cut at its blocks, one
  compile per distinct block (NOTE [blocks compiled once]; on by default).
- :mod:`.split_backward`: where a compiled-autograd backward graph is cut (NOTE [compiled-autograd backward
  compiled once per block]).
- :mod:`.symbols`: keys and guards for blocks whose inputs differ only in their size symbols (NOTE [blocks
  that differ only in their size symbols]).
- :mod:`.reuse`: Dynamo's graph deduplication into ``invoke_subgraph`` regions (NOTE [block reuse]; opt-in).
"""
