"""Per-model-family attention-forward patches, applied by :func:`astrai_hf.patch` and undone by ``unpatch``.

This folder ships inside the wheel as ``astrai_hf.patches`` (a ``package-dir`` mapping in ``pyproject.toml``), so
model-specific code stays out of the core package. Each family module exposes ``apply(model, modules) -> undo``;
``FAMILIES`` maps a ``config.model_type`` to it.
"""

from __future__ import annotations

FAMILIES: dict = {}


def apply(model, modules) -> list:
    """Apply the patch of ``model``'s family, if it has one. Returns the undo callables."""
    family = FAMILIES.get(getattr(model.config, "model_type", None))
    return [] if family is None else [family(model, modules)]
