"""``python -m dynamo_ext audit ...`` is the ``dynamo-ext`` command."""

import sys

from dynamo_ext.audit.cli import main

sys.exit(main())
