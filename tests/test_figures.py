"""The figures read at a glance (issue 32): each system its own look, the paper's headline
line on top and named, every panel's title inside the figure, the paper's figure number
in the title, and the value on every bar.

Drawn in-process from the committed results (a figure is a function of its JSON), then
read back from matplotlib's objects after a full draw.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.container import BarContainer

from benchmarks import consumers, e2e
from benchmarks.report import FIGURE_DPI, FIGURE_INCHES, load_result

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
CONSUMERS = RESULTS / "2026-11-28-dc67412" / "consumers.json"
E2E = [RESULTS / "2026-11-28-70c0cae" / "e2e.json", RESULTS / "2026-11-25-0de60e6" / "e2e-video.json"]


@pytest.fixture
def figure():
    made = plt.figure(figsize=FIGURE_INCHES, dpi=FIGURE_DPI)
    yield made
    plt.close(made)


def drawn(module: Any, path: Path, figure: Any) -> Any:
    module.plot(load_result(path), figure)
    figure.canvas.draw()  # lays the figure out, as saving it does
    return figure


def outside(figure: Any) -> list[str]:
    """The texts (titles, labels, legend entries) that stick out of the figure."""
    renderer = figure.canvas.get_renderer()
    box = figure.bbox
    texts = [figure._suptitle] if figure._suptitle else []
    for ax in figure.axes:
        texts += [ax.title, ax.xaxis.label, ax.yaxis.label, *ax.texts]
    for legend in [*figure.legends, *(ax.get_legend() for ax in figure.axes)]:
        texts += legend.get_texts() if legend else []
    out = []
    for text in texts:
        if text.get_text() and text.get_visible():
            extent = text.get_window_extent(renderer)
            if extent.x0 < box.x0 - 1 or extent.x1 > box.x1 + 1 or extent.y0 < box.y0 - 1 or extent.y1 > box.y1 + 1:
                out.append(text.get_text())
    return out


def test_consumers_gives_each_system_its_own_colour_and_marker(figure):
    drawn(consumers, CONSUMERS, figure)
    looks = {}
    for ax in figure.axes:
        for line in ax.get_lines():
            if line.get_marker() not in (None, "None", ""):
                looks.setdefault(line.get_color(), set()).add(line.get_marker())
    systems = {r["system"] for r in load_result(CONSUMERS).results}
    assert len(looks) == len(systems) == 11, looks  # eleven colours
    assert all(len(markers) == 1 for markers in looks.values()), looks
    assert len({m for markers in looks.values() for m in markers}) == len(systems) - 2  # shared by the all-ranks kinds
    legend = figure.legends[0]
    assert {t.get_text() for t in legend.get_texts()} == {consumers.STYLES[s].label for s in systems}


def test_consumers_draws_the_whole_tgb_line_on_top_and_names_it_in_every_panel(figure):
    drawn(consumers, CONSUMERS, figure)
    whole = consumers.STYLES[consumers.WHOLE_TGB]
    measured = [ax for ax in figure.axes if ax.get_lines()]
    assert len(measured) == 9  # throughput, P95 and read amplification at three payloads
    for ax in measured:
        lines = [line for line in ax.get_lines() if line.get_marker() == whole.marker]
        assert len(lines) == 1, ax.get_title()
        others = [line.get_zorder() for line in ax.get_lines() if line is not lines[0]]
        assert lines[0].get_zorder() > max(others)
        assert [t.get_text() for t in ax.texts if t.get_color() == whole.colour] == ["whole TGB"]


def test_consumers_has_a_p95_row_and_a_read_amplification_row(figure):
    drawn(consumers, CONSUMERS, figure)
    labels = [ax.get_ylabel() for ax in figure.axes if ax.get_ylabel()]
    assert len(labels) == 3 and "P95" in labels[1] and "read amplification" in labels[2], labels
    # The whole-TGB reads fetch W times what a rank uses: 128x at 128 ranks of 100 KB.
    amplification = figure.axes[6]
    top = max(y for line in amplification.get_lines() for y in line.get_ydata())
    assert 120 < top < 140


def test_consumers_titles_fit_and_name_the_papers_figure(figure):
    drawn(consumers, CONSUMERS, figure)
    assert "paper Fig. 10" in figure.get_suptitle()
    assert [ax.get_title() for ax in figure.axes[:3]] == ["100 KB per rank", "1 MB per rank", "10 MB per rank"]
    assert outside(figure) == []


@pytest.mark.parametrize("path", E2E, ids=[p.stem for p in E2E])
def test_e2e_puts_each_value_on_its_bar_and_numbers_the_figure_as_the_paper(path, figure):
    drawn(e2e, path, figure)
    result = load_result(path)
    assert "paper Fig. 5" in figure.get_suptitle()
    bars = next(ax for ax in figure.axes if any(isinstance(c, BarContainer) for c in ax.containers))
    memory = next(r["steps_per_s"] for r in result.results if r["system"] == "memory")
    expected = [f"{r['steps_per_s']:.2f} ({r['steps_per_s'] / memory:.2f}x)" for r in result.results]
    texts = [t.get_text() for t in bars.texts]
    assert texts[: len(expected)] == expected  # one value per bar, in the bars' order
    assert texts[len(expected) :] == [f"target: {e2e.TARGET_VS_MEMORY}x in-memory "]
    assert outside(figure) == []


def test_e2e_gives_a_feed_the_same_colour_as_line_and_as_bar(figure):
    drawn(e2e, E2E[0], figure)
    steps, speeds = figure.axes
    bar_colours = [tuple(bar.get_facecolor()) for bar in speeds.containers[0]]
    names = [label.get_text() for label in speeds.get_yticklabels()]
    line_colours = {line.get_label(): matplotlib.colors.to_rgba(line.get_color()) for line in steps.get_lines()}
    assert names and all(line_colours[name] == colour for name, colour in zip(names, bar_colours, strict=True))
    assert len(set(bar_colours)) == len(bar_colours)  # no two feeds alike
