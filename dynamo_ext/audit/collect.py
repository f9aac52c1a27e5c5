"""``python -m dynamo_ext.audit.collect --out DIR TARGET``: the per-rank program's command (:mod:`.rank.collect`).

Kept at this path because launchers run it by name (``dynamo-ext audit`` itself, torchrun and srun scripts).
"""

import sys

from .rank.collect import main

if __name__ == "__main__":
    sys.exit(main())
