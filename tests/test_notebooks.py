"""Every example notebook runs top to bottom (its own assertions included) and is committed without outputs."""

from pathlib import Path

import nbformat
import pytest

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).parent.parent / "examples"
# (the executed copies the README's jupyter-execute command writes, *.out.ipynb, are git-ignored and left out)
NOTEBOOKS = sorted(p for p in EXAMPLES.glob("*.ipynb") if not p.name.endswith(".out.ipynb"))


def test_there_are_notebooks():
    assert [p.name for p in NOTEBOOKS] == [
        "01_quickstart.ipynb", "02_chat_prefix_cache.ipynb", "03_memory.ipynb", "04_speed.ipynb"
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None, f"{path.name}: clear the outputs"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path):
    from nbclient import NotebookClient

    from astrai_hf.models import embedded_gguf

    try:
        embedded_gguf()
    except FileNotFoundError as e:
        pytest.skip(str(e))
    nb = nbformat.read(path, as_version=4)
    NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(EXAMPLES)}}).execute()
