"""Charts of benchmark results: the committed results redraw, and an empty result set is refused."""

import copy
from pathlib import Path

import pytest

from astrai_hf import plots

RESULTS = sorted((Path(__file__).parent.parent / "benchmarks" / "results").glob("cpu-*"))
SUITE_FILES = {"decode": "bench.json", "prefix": "prefix.json", "prefill": "prefill.json"}
# a run may hold only some suites (`--suite decode`); the newest run that holds all three draws every panel
COMPLETE = [d for d in RESULTS if all((d / f).is_file() for f in SUITE_FILES.values())]


def test_committed_results_redraw(tmp_path):
    results = plots.load_results(COMPLETE[-1])
    assert set(results) == {"decode", "prefix", "prefill"}
    out = plots.plot(results, tmp_path / "chart.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("run", RESULTS, ids=[d.name for d in RESULTS])
def test_every_committed_run_redraws_the_suites_it_holds(run, tmp_path):
    results = plots.load_results(run)
    assert set(results) == {suite for suite, name in SUITE_FILES.items() if (run / name).is_file()}
    assert plots.plot(results, tmp_path / "chart.png").stat().st_size > 10_000


def test_cli_redraw(tmp_path, capsys):
    assert plots.main([str(RESULTS[-1]), str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").stat().st_size > 10_000
    import shutil

    folder = shutil.copytree(RESULTS[-1], tmp_path / "run")
    assert plots.main([str(folder)]) == 0  # no chart named: it goes into the folder, beside the results
    assert capsys.readouterr().out.split() == [str(tmp_path / "c.png"), str(folder / "chart.png")]
    assert (folder / "chart.png").stat().st_size > 10_000


def test_cli_names_a_folder_without_results_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        plots.main([str(tmp_path)])
    assert e.value.code == 2 and "error: no known benchmark suite" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["chart", "chart.PNG", "chart.Svg"])
def test_a_chart_path_without_a_suffix_or_in_capitals_is_taken(name, tmp_path):
    plots.check_plot_path(tmp_path / name)  # (matplotlib writes a PNG where there is no suffix)


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


@pytest.mark.parametrize("suite", ["decode", "prefix", "prefill"])
def test_each_suite_alone_draws_inside_the_figure(suite):
    # one panel had been too narrow for the one-line title, cut at both ends
    import matplotlib.pyplot as plt

    fig = plots.figure({suite: plots.load_results(COMPLETE[-1])[suite]})
    try:
        renderer = fig.canvas.get_renderer()
        for text in [fig._suptitle, *(ax.title for ax in fig.axes)]:
            box = text.get_window_extent(renderer)
            assert fig.bbox.x0 <= box.x0 and box.x1 <= fig.bbox.x1 and box.y1 <= fig.bbox.y1, text.get_text()
    finally:
        plt.close(fig)


def test_a_value_that_is_not_finite_still_draws(tmp_path):
    # the legend's headroom had been computed from it: matplotlib refused an infinite axis limit
    results = plots.load_results(RESULTS[-1])
    decode = copy.deepcopy(results["decode"])
    decode["rows"][0]["decode_tok_s"] = float("inf")
    decode["rows"][1]["decode_tok_s"] = float("nan")
    assert plots.plot({"decode": decode}, tmp_path / "c.png").stat().st_size > 10_000


def test_without_matplotlib_the_error_names_the_install(tmp_path, monkeypatch):
    import sys

    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'astrai-hf\[plot\]'"):
        plots.plot(plots.load_results(RESULTS[-1]), tmp_path / "c.png")


def test_each_panel_draws_every_series_of_the_results_with_its_labels():
    import matplotlib.pyplot as plt

    results = plots.load_results(COMPLETE[-1])
    rows = results["decode"]["rows"]
    batches, caches = list(dict.fromkeys(r["batch"] for r in rows)), list(dict.fromkeys(r["cache"] for r in rows))
    get = {(r["batch"], r["cache"]): r for r in rows}
    prefill = results["prefill"]
    expected = [  # (title, ylabel, tick labels, {series: heights})
        ("decode speed", "tokens/s", [b.split(" (")[0] for b in batches],
         {c: [get[b, c]["decode_tok_s"] for b in batches] for c in caches}),
        ("KV bytes held", "MiB", [b.split(" (")[0] for b in batches],
         {c: [get[b, c]["kv_bytes"] / 2**20 for b in batches] for c in caches}),
        ("time to first token", "seconds", ["1024-token prompt, 1000 cached"],
         {k: [v] for k, v in results["prefix"]["ttft_s"].items()}),
        ("mixed-length batch of 8, end to end", "seconds",
         ["TTFT" if n == 1 else f"{n} new tokens" for n in prefill["new_tokens"]],
         {m: [per[str(n)] for n in prefill["new_tokens"]] for m, per in prefill["seconds"].items()}),
    ]
    fig = plots.figure(results)
    try:
        assert len(fig.axes) == len(expected)
        for ax, (title, ylabel, ticks, series) in zip(fig.axes, expected):
            assert (ax.get_title(), ax.get_ylabel()) == (title, ylabel)
            assert [t.get_text() for t in ax.get_xticklabels()] == ticks
            assert [t.get_text() for t in ax.get_legend().get_texts()] == list(series)
            heights = [bar.get_height() for c in ax.containers for bar in c]
            assert heights == pytest.approx([v for values in series.values() for v in values])
            for g in range(len(ticks)):  # each group's bars centred on its tick
                centres = [c[g].get_x() + c[g].get_width() / 2 for c in ax.containers]
                assert sum(centres) / len(centres) == pytest.approx(g)
            assert ax.get_ylim()[1] > max(v for values in series.values() for v in values)
    finally:
        plt.close(fig)
