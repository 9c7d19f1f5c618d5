"""The README's Python snippets run, in order, and its table of supported models matches the test matrix."""

import re
from pathlib import Path

import pytest

from support_table import table

README = Path(__file__).parent.parent / "README.md"


def test_support_table_is_current():
    assert table() in README.read_text(), "README's model table is stale: paste `python tests/support_table.py`"


@pytest.mark.slow
def test_snippets_run(tmp_path, monkeypatch):
    from astrai_hf.models import embedded_gguf

    try:
        embedded_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    snippets = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(snippets) >= 3
    monkeypatch.chdir(tmp_path)  # snippets may write files
    namespace = {"__name__": "__readme__"}
    for i, code in enumerate(snippets):
        try:
            exec(compile(code, f"README.md snippet {i + 1}", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"README snippet {i + 1} failed: {e!r}\n{code}") from e
    model = namespace["model"]
    import astrai_hf

    assert not astrai_hf.is_patched(model)
    assert (tmp_path / "prefix.safetensors").is_file()
