"""astrai-hf: a paged KV cache, prefix reuse and paged attention behind Hugging Face ``model.generate()``.

Importing this package registers nothing and patches nothing; :func:`patch` does.
"""

from .cache import PagedCache
from .errors import CacheFullError
from .patch import get_pool, is_patched, patch, unpatch
from .pool import PagePool

__version__ = "0.1.0"

__all__ = ["CacheFullError", "PagePool", "PagedCache", "get_pool", "is_patched", "patch", "unpatch", "__version__"]
