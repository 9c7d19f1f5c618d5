"""astrai-hf: a paged KV cache, prefix reuse and paged attention behind Hugging Face ``model.generate()``.

Importing this package registers nothing and patches nothing; :func:`patch` does. The library prints nothing: it
logs to the ``astrai_hf`` logger (patching at INFO; prefix-cache hits, pool pressure and evictions at DEBUG).
"""

import importlib.util
import logging
import os
import sys


def _bind_checkout_patches() -> None:
    """A source checkout put on sys.path without installing it: the per-family patches live in ``patches/`` beside
    this package, which an install ships inside it as ``astrai_hf.patches`` (pyproject.toml's package-dir). Bind
    that folder under the name, unless a finder maps the name to it already (an editable install of this
    checkout; one of another checkout would mix two versions)."""
    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "patches")
    init = os.path.join(folder, "__init__.py")
    if "astrai_hf.patches" in sys.modules or not os.path.isfile(os.path.join(folder, "autopatch.py")):
        return
    found = importlib.util.find_spec("astrai_hf.patches")
    if found is not None and found.origin and os.path.samefile(found.origin, init):
        return  # (an editable install of this checkout)
    spec = importlib.util.spec_from_file_location("astrai_hf.patches", init, submodule_search_locations=[folder])
    module = importlib.util.module_from_spec(spec)
    sys.modules["astrai_hf.patches"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["astrai_hf.patches"]
        raise
    globals()["patches"] = module  # (as the import system binds a submodule it loads on its package)


_bind_checkout_patches()

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
