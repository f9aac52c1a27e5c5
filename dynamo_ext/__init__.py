"""dynamo-ext: Dynamo and Inductor support for distributed PyTorch code.

    import dynamo_ext
    dynamo_ext.install()      # or: with dynamo_ext.enabled(): ...

Importing the package changes nothing in torch; see :func:`install`.
"""

from ._install import enabled, install, is_installed, uninstall
from .errors import CollectiveMismatchError

__all__ = ["CollectiveMismatchError", "enabled", "install", "is_installed", "uninstall"]
__version__ = "0.1.0"
