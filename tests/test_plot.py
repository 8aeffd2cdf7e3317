"""The autopsy's plot of a run: each bad step marked at its own loss, the legend saying what.

A run skips a finite spike (its loss far above the others) and a step whose loss is NaN. The
plot (`slim-nanguard-autopsy --plot`) must show the spike at its loss, not at the top of the
curve; the NaN step, which has no place on the axis, at the top with a legend entry that says
so; and a log axis, since the spike is orders of magnitude above the curve.
"""

import math

import pytest

import slim_nanguard
from slim_nanguard.app import plot as run_plot

import nanguard_testlib as lib

pytest.importorskip("matplotlib")

SPIKE_BATCH, NAN_BATCH, STEPS = 30, 40, 45


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run that skips a spike at batch 30 and a NaN loss at batch 40."""
    logdir = str(tmp_path_factory.mktemp("plotted_run"))
    model = lib.build_model(
        nan_policy="skip",
        spike_policy="skip",
        spike_warmup_steps=10,
        faults={SPIKE_BATCH: lib.SPIKE, NAN_BATCH: "nan_loss"},
    )
    with model.graph.as_default():
        result = slim_nanguard.train(
            model.train_op, logdir, number_of_steps=STEPS - 2, save_summaries_steps=1
        )
    assert (result.bad_steps, result.spikes) == (2, 1)
    return logdir


def _bad_steps(logdir):
    return [r for r in slim_nanguard.read_events(logdir) if r["kind"] == "bad_step"]


def _marks(axes):
    """``{legend label: [(x, y), ...]}`` of the scatter markers of `axes`."""
    return {
        c.get_label(): [tuple(map(float, xy)) for xy in c.get_offsets()]
        for c in axes.collections
        if not c.get_label().startswith("_")
    }


def test_each_bad_step_is_marked_at_its_own_loss_and_a_nan_at_the_top(run_dir):
    import matplotlib.pyplot as plt

    spike, nan = _bad_steps(run_dir)
    assert spike["cause"] == "spike" and math.isfinite(spike["loss"])
    assert nan["loss"] == "nan"
    figure = run_plot.run_figure(run_dir)
    try:
        whole = figure.axes[0]
        marks = _marks(whole)
        spike_mark = [(spike["step"], pytest.approx(spike["loss"]))]
        assert marks["spike, skipped, at its loss"] == spike_mark
        ((step, top),) = marks["bad step, skipped, loss NaN (drawn at the top)"]
        curve = [y for line in whole.get_lines() for y in line.get_ydata()]
        assert step == nan["step"] and top == pytest.approx(max(curve + [spike["loss"]]))
        assert whole.get_yscale() == "log"  # the spike is orders of magnitude above the curve
        legend = {t.get_text() for t in whole.get_legend().get_texts()}
        assert legend >= set(marks)
        # The close look at the first bad step shows the spike's marker inside its limits.
        low, high = figure.axes[1].get_ylim()
        assert low <= spike["loss"] <= high
    finally:
        plt.close(figure)


def test_the_plot_is_written_as_a_png(run_dir, tmp_path):
    out = run_plot.plot_run(run_dir, str(tmp_path / "run.png"))
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
