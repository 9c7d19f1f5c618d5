"""The README's table of supported model families, generated from the test matrix.

Run ``python tests/support_table.py`` to print it; ``tests/test_readme.py`` fails when the README's copy is stale.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent.parent))

from tiny_models import ARCHS, SPECS  # noqa: E402

NOTES = {
    "qwen2": "sliding-window layers",
    "mistral": "sliding window",
    "phi3": "sliding window",
    "gemma2": "alternating sliding/full layers, attention logit softcap (dropped under sdpa, as stock sdpa drops it: the default before transformers 5.24; from 5.24 sdpa refuses it, as stock's does)",
    "gemma3": "sliding/full layers",
    "gpt_neox": "calls `update()` without kwargs: unpatched, pass the mask to `PagedCache` so padding is not stored",
    "falcon": "before transformers 5.25 attention bypasses `AttentionInterface`: `patch()` raises "
              "`NotImplementedError`; from 5.25 patched and tested (ALiBi variants refused on every release)",
}


# families patch() takes from a transformers release on (tested there: test_equivalence.py)
SINCE = {"falcon": "from 5.25"}


def table() -> str:
    from astrai_hf.patches import PACKED_PREFILL

    lines = [
        "| family | class tested | `PagedCache` unpatched | `patch()` + prefix cache | packed prefill | notes |",
        "|---|---|---|---|---|---|",
    ]
    for arch, (config_cls, model_cls, _) in SPECS.items():
        tested = arch in ARCHS
        model_type = config_cls.model_type
        packed = "yes" if tested and model_type in PACKED_PREFILL else "no (padded rectangle)"
        lines.append(
            f"| {arch} | `{model_cls.__name__}` | yes | {'yes' if tested else SINCE.get(arch, '**no**')} | "
            f"{packed if tested else '-'} | {NOTES.get(arch, 'full attention')} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table(), end="")
