"""Charts of benchmark results: the committed results redraw, and an empty result set is refused."""

from pathlib import Path

import pytest

from astrai_hf import plots

RESULTS = sorted((Path(__file__).parent.parent / "benchmarks" / "results").glob("cpu-*"))


def test_committed_results_redraw(tmp_path):
    results = plots.load_results(RESULTS[-1])
    assert set(results) == {"decode", "prefix", "prefill"}
    out = plots.plot(results, tmp_path / "chart.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_redraw(tmp_path, capsys):
    assert plots.main([str(RESULTS[-1]), str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 10_000


def test_nothing_to_draw(tmp_path):
    with pytest.raises(ValueError, match="no known benchmark suite"):
        plots.plot({}, tmp_path / "x.png")


def test_cli_names_a_missing_folder(tmp_path, capsys):
    missing = tmp_path / "no-such-results"
    with pytest.raises(SystemExit) as e:
        plots.main([str(missing)])
    assert e.value.code == 2
    assert str(missing) in capsys.readouterr().err
    with pytest.raises(FileNotFoundError, match="no-such-results"):
        plots.load_results(missing)
