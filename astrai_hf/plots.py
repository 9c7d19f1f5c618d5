"""Charts of ``astrai-hf bench`` results (matplotlib), one panel per measurement, side by side.

``astrai-hf bench --plot chart.png`` draws the suites it just ran; ``python -m astrai_hf.plots DIR [chart.png]``
redraws from the JSON files a ``bench --out DIR`` wrote (``bench.json``, ``prefix.json``, ``prefill.json``).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

SUITE_FILES = {"decode": "bench.json", "prefix": "prefix.json", "prefill": "prefill.json"}


def load_results(folder: str | Path) -> dict:
    """The results of each suite found in ``folder``, keyed ``decode`` / ``prefix`` / ``prefill``.

    Raises:
        FileNotFoundError: ``folder`` is not a directory.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"results folder {str(folder)!r} does not exist or is not a directory")
    return {suite: json.loads((folder / name).read_text()) for suite, name in SUITE_FILES.items()
            if (folder / name).is_file()}


def _bars(ax, groups: list[str], series: dict[str, list[float]], ylabel: str, title: str) -> None:
    width = 0.8 / max(len(series), 1)
    for i, (name, values) in enumerate(series.items()):
        xs = [g + (i - (len(series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, values, width=width, label=name)
    ax.set_xticks(range(len(groups)), groups)
    ax.set(ylabel=ylabel, title=title)
    top = max((v for values in series.values() for v in values if math.isfinite(v)), default=0)
    if top > 0:
        ax.set_ylim(0, top * (1.15 + 0.12 * len(series)))  # headroom above the bars for the legend's lines
    ax.legend(fontsize=7, loc="upper right")


def check_plot_path(path: str | Path) -> None:
    """Fail now, not after the benchmarks ran, where ``path`` cannot take a chart.

    Raises:
        ImportError: matplotlib is not installed (``pip install astrai-hf[plot]``).
        ValueError: matplotlib writes no file of ``path``'s suffix without more software (``.pgf`` needs TeX).
    """
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError as e:
        raise ImportError("charts need matplotlib: pip install 'astrai-hf[plot]'") from e
    suffix = Path(path).suffix.lower().lstrip(".")
    supported = {k: v for k, v in FigureCanvasBase.get_supported_filetypes().items() if k != "pgf"}  # (needs TeX)
    if suffix and suffix not in supported:  # (no suffix: matplotlib writes a PNG)
        raise ValueError(f"cannot draw a chart into {str(path)!r}: name a file ending in one of "
                         f"{', '.join('.' + k for k in sorted(supported))} (e.g. chart.png)")


def plot(results: dict, path: str | Path) -> Path:
    """Draw every suite in ``results`` (as :func:`load_results` returns) into one PNG at ``path``.

    Raises:
        ImportError: matplotlib is not installed (``pip install astrai-hf[plot]``).
        ValueError: ``results`` holds no known suite.
    """
    fig = figure(results)  # (first: it names the install when matplotlib is missing)
    import matplotlib.pyplot as plt

    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def figure(results: dict):
    """The matplotlib figure :func:`plot` saves: one panel per measure, the environment in a two-line title.

    Raises:
        ImportError, ValueError: as :func:`plot`.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError("charts need matplotlib: pip install 'astrai-hf[plot]'") from e
    panels = []  # (groups, series, ylabel, title)
    if "decode" in results:
        rows = results["decode"]["rows"]
        batches = list(dict.fromkeys(r["batch"] for r in rows))
        caches = list(dict.fromkeys(r["cache"] for r in rows))
        labels = [b.split(" (")[0] for b in batches]
        get = {(r["batch"], r["cache"]): r for r in rows}
        panels.append((labels, {c: [get[b, c]["decode_tok_s"] for b in batches] for c in caches}, "tokens/s",
                       "decode speed"))
        panels.append((labels, {c: [get[b, c]["kv_bytes"] / 2**20 for b in batches] for c in caches}, "MiB",
                       "KV bytes held"))
    if "prefix" in results:
        ttft = results["prefix"]["ttft_s"]
        panels.append((["1024-token prompt, 1000 cached"], {k: [v] for k, v in ttft.items()}, "seconds",
                       "time to first token"))
    if "prefill" in results:
        r = results["prefill"]
        ns = [int(n) for n in r["new_tokens"]]
        series = {m: [per[str(n)] if str(n) in per else per[n] for n in ns] for m, per in r["seconds"].items()}
        panels.append((["TTFT" if n == 1 else f"{n} new tokens" for n in ns], series, "seconds",
                       "mixed-length batch of 8, end to end"))
    if not panels:
        raise ValueError(f"no known benchmark suite in the results (expected some of {sorted(SUITE_FILES)})")
    fig, axes = plt.subplots(1, len(panels), figsize=(max(4.5 * len(panels), 5.0), 3.8), squeeze=False)
    for (groups, series, ylabel, title), ax in zip(panels, axes[0]):
        _bars(ax, groups, series, ylabel, title)
    env = next(iter(results.values())).get("env", {})
    fig.suptitle(f"astrai-hf, embedded model, {env.get('device', '')} {env.get('dtype', '')}\n"
                 f"transformers {env.get('transformers', '')}, {env.get('date', '')}", fontsize=9)
    fig.tight_layout()
    return fig


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m astrai_hf.plots",
                                     description="Redraw the chart of the results an `astrai-hf bench --out DIR` wrote.")
    parser.add_argument("folder", type=Path, help="folder holding bench.json / prefix.json / prefill.json")
    parser.add_argument("chart", type=Path, nargs="?", help="PNG to write (default: FOLDER/chart.png)")
    args = parser.parse_args(argv)
    try:
        results = load_results(args.folder)
        out = plot(results, args.chart or args.folder / "chart.png")
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
