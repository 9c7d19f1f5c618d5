"""Zero-code patching: route every ``generate()`` of an unmodified script through astrai-hf.

:func:`install` wraps ``transformers.GenerationMixin.generate`` so that the first ``generate()`` call on a model
patches that model (:func:`astrai_hf.patch`) and every call then runs through its paged pool. The script itself
never imports astrai-hf. ``astrai-hf run script.py ARGS`` installs the hook and runs the script as ``__main__``;
:func:`uninstall` removes it. Models whose attention cannot be patched (e.g. Falcon) keep stock ``generate()``,
with a warning in the log.

Pool settings come from :func:`install`'s arguments, or from the environment (``astrai-hf run`` fills it):
``ASTRAI_HF_MAX_TOKENS``, ``ASTRAI_HF_PAGE_SIZE``, ``ASTRAI_HF_MAX_REQS``, ``ASTRAI_HF_PREFIX_CACHE`` (``0``,
``false``, ``no`` or ``off`` turns the prefix cache off).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import weakref

logger = logging.getLogger(__name__)

_installed: dict = {}
_models: "weakref.WeakSet" = weakref.WeakSet()


def settings_from_env(environ=None) -> dict:
    """Pool keyword arguments read from ``ASTRAI_HF_*`` variables.

    Raises:
        ValueError: ``ASTRAI_HF_MAX_TOKENS``, ``ASTRAI_HF_PAGE_SIZE`` or ``ASTRAI_HF_MAX_REQS`` is not an integer
            (:func:`install` checks the sizes), or
            ``ASTRAI_HF_PREFIX_CACHE`` is none of 1/0, true/false, yes/no, on/off.
    """
    environ = os.environ if environ is None else environ
    out = {}
    for var, key in (("ASTRAI_HF_MAX_TOKENS", "max_tokens"), ("ASTRAI_HF_PAGE_SIZE", "page_size"),
                     ("ASTRAI_HF_MAX_REQS", "max_reqs")):
        if environ.get(var):
            try:
                out[key] = int(environ[var])
            except ValueError:
                raise ValueError(f"{var}={environ[var]!r} is not an integer") from None
    flag = environ.get("ASTRAI_HF_PREFIX_CACHE", "").strip().lower()
    if flag in _OFF:
        out["prefix_cache"] = False
    elif flag not in _ON:
        raise ValueError(f"ASTRAI_HF_PREFIX_CACHE={environ['ASTRAI_HF_PREFIX_CACHE']!r}: use 0/false/no/off or "
                         "1/true/yes/on")
    return out


_OFF, _ON = ("0", "false", "no", "off"), ("", "1", "true", "yes", "on")


def install(**pool_kwargs) -> None:
    """Patch every model on its first ``generate()`` call (idempotent).

    Args:
        **pool_kwargs: sizing for each model's pool, as for :class:`astrai_hf.PagePool`; defaults come from
            :func:`settings_from_env`.

    Raises:
        ValueError / TypeError: a size is not a positive integer (checked now, not at the first generate()).
    """
    from transformers.generation.utils import GenerationMixin

    from astrai_hf.config import as_count
    from astrai_hf.pool import PagePool, check_holds_a_page

    if "generate" in _installed:
        return
    settings = {**settings_from_env(), **pool_kwargs}
    for name in ("max_tokens", "page_size", "max_seq_len", "max_reqs"):
        if settings.get(name) is not None:
            as_count(name, settings[name], 1)
    page_size = settings.get("page_size") or inspect.signature(PagePool.__init__).parameters["page_size"].default
    if settings.get("max_tokens") is not None:
        # (checked now: each model's patch() would raise it inside the script, at its first generate())
        check_holds_a_page(settings["max_tokens"], page_size)
    original = GenerationMixin.generate

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        import astrai_hf

        # A patched model's own generate() (an instance attribute) comes back here for the stock loop.
        if astrai_hf.is_patched(self) or self in _models:
            return original(self, *args, **kwargs)
        try:
            astrai_hf.patch(self, **settings)
        except NotImplementedError as e:
            _models.add(self)
            logger.warning("astrai-hf left %s unpatched: %s", type(self).__name__, e)
            return original(self, *args, **kwargs)
        # (any other error propagates, and the next call tries again: never a silent switch to stock generate())
        _models.add(self)
        logger.info("astrai-hf patched %s: %s", type(self).__name__, astrai_hf.get_pool(self))
        return self.generate(*args, **kwargs)

    _installed["generate"] = (GenerationMixin, original)
    GenerationMixin.generate = generate
    logger.info("astrai-hf auto-patch installed (%s)", settings or "default pool")


def uninstall() -> None:
    """Remove the hook; models it patched stay patched (``astrai_hf.unpatch`` them if needed)."""
    entry = _installed.pop("generate", None)
    if entry is not None:
        cls, original = entry
        cls.generate = original


def patched_models() -> list:
    """The models the hook has seen and that are still alive (patched, or left alone because they cannot be), in
    no particular order (they are held weakly, in a ``weakref.WeakSet``)."""
    return list(_models)
