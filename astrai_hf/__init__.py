"""astrai-hf: a paged KV cache, prefix reuse and paged attention behind Hugging Face ``model.generate()``.

Importing this package registers nothing and patches nothing; :func:`patch` does. The library prints nothing: it
logs to the ``astrai_hf`` logger (patching at INFO; prefix-cache hits, pool pressure and evictions at DEBUG).
"""

import logging
import os

# A source checkout put on sys.path without installing it: the per-family patches live in patches/ beside this
# package, which an install ships inside it as astrai_hf.patches (pyproject.toml's package-dir); the checkout's
# folder on this package's path finds them there.
_checkout = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if (not os.path.isdir(os.path.join(__path__[0], "patches"))
        and os.path.isfile(os.path.join(_checkout, "patches", "autopatch.py"))
        and os.path.isfile(os.path.join(_checkout, "pyproject.toml"))):
    __path__.append(_checkout)
del _checkout

from .cache import PagedCache, cache_kwarg
from .errors import CacheFullError
from .patch import capture_graphs, get_pool, is_patched, patch, patched, unpatch
from .pool import PagePool

logging.getLogger(__name__).addHandler(logging.NullHandler())

__version__ = "0.1.0"

__all__ = [
    "CacheFullError", "PagePool", "PagedCache", "cache_kwarg", "capture_graphs", "get_pool", "is_patched", "patch",
    "patched", "unpatch", "__version__",
]
