"""Plots a person can read: an experiment's long titles stay inside the picture."""

from __future__ import annotations

import matplotlib.pyplot as plt

from simulator.plots import fit_titles, line_plot

TITLE = "Fig. 12, workload2 on sim-256: max rho, T_id >= 10 min (mean, 95% CI, 5 seeds)"


def _title_inside(fig) -> bool:
    fig.tight_layout()
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box, page = fig.axes[0].title.get_window_extent(renderer), fig.bbox
    return page.x0 <= box.x0 and box.x1 <= page.x1


def test_a_long_title_is_wrapped_to_fit_the_figure():
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot([1, 2, 4], [1.7, 1.7, 1.9])
    ax.set_title(TITLE)
    assert not _title_inside(fig)  # as it was drawn before
    fit_titles(fig)
    assert _title_inside(fig)
    assert ax.get_title().replace("\n", " ") == TITLE  # wrapped, not cut
    plt.close(fig)


def test_line_plot_writes_a_png_with_error_bars(tmp_path):
    path = line_plot(tmp_path / "p.png", [1, 2, 4], {"themis": [1.0, 2.0, 3.0]}, xlabel="x", ylabel="y",
                     title=TITLE, errors={"themis": [0.1, 0.2, 0.3]})
    assert path.read_bytes()[:4] == b"\x89PNG"
