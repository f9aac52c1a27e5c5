"""What the autograd engine runs in the backward of a compiled graph.

- :mod:`.backward_hooks` and :mod:`.backward_hook_ops`: module full backward hooks without compiled autograd;
- :mod:`.accumulate_grad`: a DTensor leaf's first gradient under compiled autograd keeps its placements.
"""
