"""Per-model-family attention-forward patches, applied by :func:`astrai_hf.patch` and undone by ``unpatch``.

This folder ships inside the wheel as ``astrai_hf.patches`` (a ``package-dir`` mapping in ``pyproject.toml``), so
model-specific code stays out of the core package. Each family module exposes ``apply(model, modules) -> undo``;
``FAMILIES`` maps a ``config.model_type`` to it.
"""

from __future__ import annotations

FAMILIES: dict = {}

# Families whose forward is position-wise outside attention (embeddings, norms, MLPs and positions depend only on
# each token and its position_ids), so a prefill may be packed into one ragged sequence. Every entry is covered by
# the packed-prefill tests; add a model_type here to opt another such family in.
PACKED_PREFILL: set[str] = {
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "gpt2", "opt", "gpt_neox",
}


def apply(model, modules) -> list:
    """Apply the patch of ``model``'s family, if it has one. Returns the undo callables."""
    family = FAMILIES.get(getattr(model.config, "model_type", None))
    return [] if family is None else [family(model, modules)]
