"""astrai-hf: a paged KV cache, prefix reuse and paged attention behind Hugging Face ``model.generate()``.

Importing this package registers nothing and patches nothing; :func:`patch` does. The library prints nothing: it
logs to the ``astrai_hf`` logger (patching at INFO; prefix-cache hits, pool pressure and evictions at DEBUG).
"""

import logging

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
