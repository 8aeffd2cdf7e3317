"""The plot of ``slim-nanguard-autopsy TRAIN_DIR --plot=run.png``: a run's loss over its global
steps, from its TensorBoard event files and its record, with the guard's bad steps, skips and
rollbacks marked. Needs matplotlib (the ``plot`` extra), imported only when a figure is drawn.
"""

from __future__ import annotations

import bisect
import math
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import slim_nanguard
from slim_nanguard import storage

NON_FINITE = slim_nanguard.Fault.NON_FINITE

LOSS_TAGS = ("nanguard/loss", "total_loss", "losses/total_loss", "loss")
# The name of the loss drawn when the run wrote no TensorBoard loss, only its record.
RECORD_TAG = "loss"

Point = Tuple[int, float]


def read_scalars(train_dir: str, tags: Sequence[str] = LOSS_TAGS) -> Tuple[str, List[Point]]:
    """``(tag, [(step, value), ...])``: the series of `tags` with the most points (the first on
    a tie) in `train_dir`'s TensorBoard event files, in the order written.

    Raises:
      ValueError: No event file, or none of the tags in it.
    """
    tag, written = _scalar_events(train_dir, tags)
    return tag, [(step, value) for _, step, value in written]


def _scalar_events(
    train_dir: str, tags: Sequence[str]
) -> Tuple[str, List[Tuple[float, int, float]]]:
    """`read_scalars`, each point with its wall time first."""
    import tensorflow as tf

    files = sorted(tf.io.gfile.glob(storage.join(train_dir, "events.out.tfevents.*")))
    if not files:
        raise ValueError(
            f"{train_dir} has no TensorBoard event files (events.out.tfevents.*) "
            "to plot the loss from."
        )
    series: Dict[str, List[Tuple[float, int, float]]] = {}
    for path in files:
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag in tags and value.HasField("simple_value"):
                    series.setdefault(value.tag, []).append(
                        (event.wall_time, int(event.step), value.simple_value)
                    )
    if not series:
        raise ValueError(
            f"the event files of {train_dir} hold none of the scalars "
            f"{', '.join(tags)}; train with summaries on (save_summaries_steps) to "
            "plot the loss."
        )
    tag = max((t for t in tags if t in series), key=lambda t: len(series[t]))  # first on a tie
    return tag, sorted(series[tag])


def split_at_rollbacks(points: Sequence[Point]) -> List[Tuple[List[Point], List[Point]]]:
    """Splits a series written in order into ``(kept, dropped)`` runs: a step not above the
    one before starts a run and undoes the previous run's points from that step on
    (``dropped``, led by the last kept point so the lines join)."""
    return _split([(None, point) for point in points])


def _split(points: Sequence[Tuple[Optional[int], Point]]) -> List[Tuple[List, List]]:
    """`split_at_rollbacks` of ``(restart, point)`` items: an item with a ``restart`` step (the
    first after a rollback) starts a run too, and undoes the points from that step on."""
    runs: List[Tuple[Optional[int], List[Point]]] = []
    for restart, point in points:
        if runs and restart is None and point[0] > runs[-1][1][-1][0]:
            runs[-1][1].append(point)
        else:
            runs.append((restart, [point]))
    restarts = [run[0][0] if step is None else step for step, run in runs[1:]] + [math.inf]
    pieces = []
    for (_, run), restart in zip(runs, restarts):
        kept = [p for p in run if p[0] < restart]
        dropped = [p for p in run if p[0] >= restart]
        pieces.append((kept, [kept[-1]] + dropped if kept and dropped else dropped))
    return pieces


def loss_pieces(train_dir: str) -> Tuple[str, List[Tuple[List[Point], List[Point]]]]:
    """``(tag, pieces)``: the loss over steps as `plot_run` draws it, one ``(kept, dropped)``
    pair per run as `split_at_rollbacks` makes, cut where the run went back (a rollback, to
    its checkpoint's step, or a resumed run), and the TensorBoard tag drawn (`RECORD_TAG` when
    the record alone has losses). From the TensorBoard scalars and the records'
    ``losses_before`` (which replace the summaries of the steps they cover), without NaN and Inf.

    Raises:
      ValueError: No TensorBoard loss and no record of losses.
    """
    records = slim_nanguard.read_events(train_dir)
    kept_losses = [r for r in records if r.get("kind") == "bad_step" and r.get("losses_before")]
    try:
        tag, written = _scalar_events(train_dir, LOSS_TAGS)
    except ValueError:
        if not kept_losses:
            raise
        tag, written = RECORD_TAG, []
    # Each rollback starts a stretch: the time it was decided, the step it went back to.
    rollbacks = sorted(
        (float(r["time"]), storage.checkpoint_step(str(r.get("checkpoint") or "")))
        for r in records
        if r.get("kind") == "rollback" and "time" in r
    )
    times = [t for t, _ in rollbacks]  # A point's stretch: the rollbacks decided before it.
    items, covered, seen = [], {}, set()
    for record in kept_losses:
        time, pairs = float(record.get("time", 0.0)), record["losses_before"]
        number = bisect.bisect_left(times, time)
        # Up to the bad step: a summary there holds the last good loss, or the bad one.
        covered.setdefault(number, []).append((pairs[0][0], record.get("step", pairs[-1][0])))
        for back, (step, value) in enumerate(reversed(pairs), start=1):
            # Each step once per stretch, though close bad steps' records overlap.
            if (number, step) not in seen and math.isfinite(value):
                seen.add((number, step))
                items.append((time - back * 1e-6, number, int(step), value))
    for time, step, value in written:
        number = bisect.bisect_left(times, time)
        spans = covered.get(number, ())
        if math.isfinite(value) and not any(low <= step <= high for low, high in spans):
            items.append((time, number, step, value))
    marked, last = [], 0
    for _, number, step, value in sorted(items):
        restart = None
        if number != last:  # The first point after one rollback or more: the lowest step.
            steps = [s for _, s in rollbacks[last:number] if s is not None]
            restart, last = min(steps, default=step), number
        marked.append((restart, (step, value)))
    return tag, _split(marked)


def zoom_window(record: Mapping[str, Any], margin: int = 20) -> Tuple[float, float]:
    """``(low, high)`` steps of a close look at `record`'s bad step: from its first kept loss
    (or `margin` steps before), to a quarter of that span past it."""
    step = int(record.get("step", 0))
    before = [s for s, _ in record.get("losses_before") or ()]
    first = min(before) if before else step - margin
    span = max(step - first, 1)
    return first - max(span / 20, 0.5), step + max(span / 4, 2)


def plot_run(train_dir: str, out_path: str) -> str:
    """Draws `run_figure` of `train_dir` into the image `out_path` (a URL too); returns it.

    Raises:
      ImportError: matplotlib is not installed (install the ``plot`` extra).
      ValueError: No loss to plot.
    """
    import tensorflow as tf

    figure = run_figure(train_dir)
    try:
        with tf.io.gfile.GFile(out_path, "wb") as f:  # A URL too (gs://...).
            figure.savefig(f, dpi=100, format=os.path.splitext(out_path)[1][1:] or None)
    finally:
        _pyplot().close(figure)
    return out_path


def _pyplot():
    """matplotlib's pyplot on the Agg backend; an ImportError that says how to install it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError(
            "--plot needs matplotlib, which is not installed; install it from the "
            "slim_nanguard clone with pip install '.[plot]' (or pip install matplotlib)."
        ) from err
    return plt


def run_figure(train_dir: str):
    """The figure `plot_run` saves (and raises as it does): the whole run, and a close look at
    the first bad step. Each bad step is marked at its loss (a NaN or Inf one at the top,
    labelled so), a spike with a marker of its own; the axis is logarithmic when the values are
    far apart. Returns a matplotlib ``Figure`` (the caller closes it) whose first axes, with the
    legend, is the whole run.
    """
    plt = _pyplot()
    tag, pieces = loss_pieces(train_dir)
    records = slim_nanguard.read_events(train_dir)
    bad = [r for r in records if r.get("kind") == "bad_step"]
    if bad:  # The whole run, and a close look at the first bad step.
        figure, (whole, close) = plt.subplots(
            1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]}
        )
    else:
        figure, whole = plt.subplots(figsize=(9, 4.5))
    for axes in figure.axes:
        marks = _draw(axes, tag, pieces, records)
    name = storage.basename(storage.absolute(train_dir).rstrip("/"))
    whole.set_title(f"{name}: the loss and the guard's events")
    whole.legend(loc="best", fontsize="small")
    if bad:
        low, high = zoom_window(bad[0])
        close.set_xlim(low, high)
        points = [p for run in pieces for part in run for p in part] + [m[:2] for m in marks]
        shown = [v for s, v in points if low <= s <= high]
        if shown:  # The loss and the marks in the window, not the whole run.
            close.set_ylim(*_padded(close, min(shown), max(shown)))
        close.set_title(f"around the first bad step (global step {bad[0].get('step')})")
    figure.tight_layout()
    return figure


def _padded(axes, low: float, high: float) -> Tuple[float, float]:
    """`low` and `high` with a margin, on the scale of `axes`."""
    if axes.get_yscale() == "log" and low > 0:
        ratio = (high / low) ** 0.05 if high > low else 2.0
        return low / ratio, high * ratio
    pad = (high - low) * 0.05 or abs(high) * 0.05 or 1.0
    return low - pad, high + pad


# How a bad step is marked, by what was done: (marker, colour, what the legend says).
_ACTION_MARKS = {
    "skip": ("x", "tab:orange", "skipped"),
    "rollback": ("v", "tab:red", "rolled back"),
    "stop": ("s", "tab:purple", "stopped"),
    "raise": ("X", "black", "gave up"),
}


def _bad_step_mark(record: Mapping[str, Any]) -> Tuple[str, str, str]:
    """The marker, colour and legend label of a bad step's record, by its action; a step a
    reason rejected with finite values (a spike) is a diamond, in the action's colour."""
    marker, color, done = _ACTION_MARKS.get(record.get("action"), _ACTION_MARKS["skip"])
    cause = record.get("cause", NON_FINITE)
    if cause != NON_FINITE:
        return "D", color, f"{cause}, {done}"
    return marker, color, f"bad step, {done}"


def _event_marks(
    records: Sequence[Mapping[str, Any]], curve: Sequence[float]
) -> List[Tuple[int, float, str, str, str]]:
    """``(step, y, marker, colour, label)`` per bad step of `records`: at its loss, or for a
    NaN or Inf loss at the top of `curve` and the finite marks, labelled so."""
    bad = [r for r in records if r.get("kind") == "bad_step"]
    losses = [_record_loss(r) for r in bad]
    top = max((v for v in [*curve, *losses] if math.isfinite(v)), default=1.0)
    marks = []
    for record, loss in zip(bad, losses):
        marker, color, label = _bad_step_mark(record)
        if math.isfinite(loss):
            y, where = loss, "at its loss"
        else:
            kind = "NaN" if math.isnan(loss) else ("-Inf" if loss < 0 else "Inf")
            y, where = top, f"loss {kind} (drawn at the top)"
        marks.append((record.get("step", 0), y, marker, color, f"{label}, {where}"))
    return marks


def _record_loss(record: Mapping[str, Any]) -> float:
    """A bad step's loss from its record (``"nan"``, ``"inf"``, ``"-inf"`` or a number)."""
    try:
        return float(record.get("loss", "nan"))
    except (TypeError, ValueError):
        return math.nan


def _draw(axes, tag: str, pieces, records) -> List[Tuple[int, float, str, str, str]]:
    """Draws the loss (a dropped stretch grey), the bad steps and the rollbacks on `axes`;
    returns the `_event_marks`."""
    labels = set()

    def once(label):
        if label in labels:
            return None
        labels.add(label)
        return label

    for kept, dropped in pieces:
        if dropped:
            label = once("dropped by a rollback")
            axes.plot(*zip(*dropped), color="0.6", lw=1.2, ls="--", label=label)
        axes.plot(
            [s for s, _ in kept], [v for _, v in kept], color="tab:blue", lw=1.2, label=once(tag)
        )
    curve = [v for run in pieces for part in run for _, v in part]
    marks = _event_marks(records, curve)
    values = curve + [m[1] for m in marks]
    # Losses 100 times apart (a divergence, or a spike, spans orders of magnitude): a log axis.
    if values and min(values) > 0 and max(values) / min(values) > 100.0:
        axes.set_yscale("log")
    for step, value, marker, color, label in marks:
        axes.scatter([step], [value], marker=marker, color=color, zorder=3, label=once(label))
    for r in records:
        if r.get("kind") == "rollback":
            axes.axvline(r.get("step", 0), color="tab:red", ls="--", lw=0.8, label=once("rollback"))
    axes.set_xlabel("global step")
    axes.set_ylabel(tag)
    return marks
