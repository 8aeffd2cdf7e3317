"""Reading a run's autopsies after the fact: the report, the offline replay, the plot.

What ``slim-nanguard-autopsy TRAIN_DIR`` prints and does, as library functions (the command
only parses flags and calls these):

* `find_bad_step` picks the record of a bad step from ``nanguard_events.jsonl``;
* `format_report` turns it into a few lines for a terminal;
* `replay_dump` rebuilds the graph from the checkpoint's meta graph and replays the step from
  the dump alone (the batch and the weights it read), on any machine;
* `plot_run` draws the loss over steps from the TensorBoard events, with every bad step, skip
  and rollback of the record marked on it (needs matplotlib: the ``plot`` extra).
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from slim_nanguard import _autopsy
from slim_nanguard import _paths
from slim_nanguard import _record


def bad_steps(train_dir: str) -> List[Dict[str, Any]]:
    """The ``bad_step`` records of a run, oldest first."""
    return [r for r in _record.read_events(train_dir) if r.get("kind") == "bad_step"]


def find_bad_step(train_dir: str, step: Optional[int] = None) -> Dict[str, Any]:
    """The record of a bad step of a run.

    Args:
      train_dir: The training directory.
      step: The global step; None for the latest bad step that has an autopsy (else the
        latest bad step).

    Returns:
      The record (the last one of that step: a rollback can bring a step back).

    Raises:
      ValueError: The directory has no event record, no bad step, or none at `step`; the
        message lists the bad steps there are.
    """
    import tensorflow as tf  # Local, as elsewhere here.

    records = bad_steps(train_dir)
    path = _paths.join(train_dir, _record.EVENTS_FILENAME)
    if not records:
        where = path if tf.io.gfile.exists(path) else f"{train_dir} (no {_record.EVENTS_FILENAME})"
        raise ValueError(f"no bad step recorded in {where}: nothing to show.")
    if step is None:
        autopsied = [r for r in records if r.get("autopsy")]
        return (autopsied or records)[-1]
    matching = [r for r in records if r.get("step") == step]
    if not matching:
        known = ", ".join(str(s) for s in sorted({r.get("step") for r in records}))
        raise ValueError(
            f"no bad step {step} in {path}; the bad steps recorded are at global step {known}."
        )
    return matching[-1]


def format_report(record: Mapping[str, Any]) -> str:
    """A few lines on one bad step and its autopsy, for a terminal."""
    lines = [
        f"bad step at global step {record.get('step')} ({record.get('mode')} mode): loss "
        f"{record.get('loss')} ({record.get('loss_kind')}), action {record.get('action')}"
    ]
    if record.get("culprits"):
        lines.append(f"  culprits    non-finite gradients of {', '.join(record['culprits'])}")
    autopsy = record.get("autopsy")
    if not autopsy:
        lines.append("  autopsy     none (autopsies off, or past autopsy_max_steps)")
        return "\n".join(lines)
    result = _autopsy.Autopsy.from_json(autopsy)
    lines.append(f"  autopsy     {result.describe()}")
    op = result.first_bad_op
    if op:
        lines.append(f"  op          {op['name']} ({op['type']})")
        for number, frame in enumerate(op.get("traceback") or []):
            lines.append(f"  {'built at' if number == 0 else '':<12}{frame}")
        for h in op.get("inputs") or []:
            lines.append(f"  input       {describe_health(h)}")
        for h in op.get("output") or []:
            lines.append(f"  output      {describe_health(h)}")
    if result.bad_examples:
        examples = list(result.bad_examples)
        shown = (
            f"all {len(examples)}"
            if len(examples) == result.batch_size
            else ", ".join(map(str, examples[:20]))
            + (f" and {len(examples) - 20} more" if len(examples) > 20 else "")
        )
        at = f", from {op['examples_at']} on" if op and op.get("examples_at") else ""
        lines.append(f"  examples    {shown} (of {result.batch_size} in the batch{at})")
    if result.dump:
        lines.append(f"  dump        {result.dump}")
    cost = result.cost or {}
    if cost:
        lines.append(
            f"  cost        {cost.get('seconds', 0):.3g} s, {cost.get('runs', '?')} "
            f"runs, at most {cost.get('peak_bytes', 0)} bytes fetched at once"
        )
    return "\n".join(lines)


def describe_health(h: Mapping[str, Any]) -> str:
    """``name [6] float32: 1 -Inf, 1 zero, finite in [0, 5.17]`` for a health dict."""
    counts = [
        f"{h[k]} {w}"
        for k, w in (("nan", "NaN"), ("posinf", "+Inf"), ("neginf", "-Inf"))
        if h.get(k)
    ]
    if h.get("zeros"):
        counts.append(f"{h['zeros']} zero{'s' if h['zeros'] > 1 else ''}")
    low, high = h.get("finite_min"), h.get("finite_max")
    span = (
        f"finite in [{low:.6g}, {high:.6g}]"
        if low is not None and high is not None
        else ("no finite value")
    )
    shape = "x".join(str(d) for d in h.get("shape") or []) or "scalar"
    return f"{h.get('name', '?')} [{shape}] {h.get('dtype', '')}: {', '.join(counts + [span])}"


def replay_dump(
    dump_path: str, train_dir: str, *, timeout_secs: float = _autopsy.DEFAULT_TIMEOUT_SECS
) -> _autopsy.Autopsy:
    """Replays a bad step offline, from the checkpoint's meta graph and the dump.

    The graph comes from the ``.meta`` file of the latest checkpoint of `train_dir` (every
    checkpoint of a run has the same graph). The batch and, when the dump holds them, the
    weights the step read are fed; the checkpoint is restored first, for whatever the dump
    does not hold.

    Args:
      dump_path: The JSON report of the dump (the record's ``autopsy.dump``).
      train_dir: The training directory (for the meta graph and the checkpoint).
      timeout_secs: The deadline of the replay.

    Returns:
      The `Autopsy` of the replay (``error`` says if it could not be done).

    Raises:
      ValueError: No checkpoint (so no meta graph) in `train_dir`, or no such dump.
    """
    import tensorflow as tf  # Local: the report alone needs no TensorFlow.

    if not tf.io.gfile.exists(dump_path):
        raise ValueError(
            f"the dump {dump_path} does not exist (was the run's directory "
            "moved? pass the directory the dump sits in)."
        )
    report, batch, weights = _autopsy.read_dump(dump_path)
    checkpoint = tf.train.latest_checkpoint(train_dir)
    meta = checkpoint + ".meta" if checkpoint else None
    if meta is None or not tf.io.gfile.exists(meta):
        metas = sorted(tf.io.gfile.glob(_paths.join(train_dir, "*.meta")))
        if not metas:
            raise ValueError(
                f"{train_dir} has no checkpoint meta graph (*.meta) to rebuild "
                "the graph from; replay needs the run's checkpoint directory."
            )
        meta = metas[-1]
    graph = tf.Graph()
    with graph.as_default():
        saver = tf.compat.v1.train.import_meta_graph(meta, clear_devices=True)
    step = int(report.get("step", -1))
    with tf.compat.v1.Session(graph=graph) as sess:
        try:
            if checkpoint and saver is not None:
                saver.restore(sess, checkpoint)
            feeds = {graph.get_tensor_by_name(name): value for name, value in batch.items()}
            feeds.update({graph.get_tensor_by_name(name): value for name, value in weights.items()})
            result = _autopsy.replay(
                sess,
                feeds,
                report["targets"],
                timeout_secs=timeout_secs,
                step=step,
                batch_size=int(report.get("batch_size") or 0) or None,
            )
        except (KeyError, ValueError, tf.errors.OpError) as err:
            # A graph that is not the run's, a tensor that cannot be fed.
            return _autopsy.Autopsy(
                step=step,
                error=f"{type(err).__name__}: "
                f"{str(getattr(err, 'message', '') or err).splitlines()[0]}",
            )
    op = result.first_bad_op
    recorded = report.get("first_bad_op") or {}
    if op is not None and not op.get("traceback") and recorded.get("name") == op["name"]:
        # An imported graph has no Python tracebacks: the recorded one is the same op's.
        op = dict(op, traceback=recorded.get("traceback", []), where=recorded.get("where", ""))
        result = _replace(result, first_bad_op=op)
    if not weights:
        note = (
            f"the dump holds no weights (too big to keep): replayed with {checkpoint}, "
            "which may predate the bad step"
        )
        result = _replace(result, error=f"{result.error}; {note}" if result.error else note)
    return result


def _replace(result: _autopsy.Autopsy, **changes) -> _autopsy.Autopsy:
    import dataclasses

    return dataclasses.replace(result, **changes)


# ---------------------------------------------------------------------- the plot
LOSS_TAGS = ("nanguard/loss", "total_loss", "losses/total_loss", "loss")


def read_scalars(
    train_dir: str, tags: Sequence[str] = LOSS_TAGS
) -> Tuple[str, List[Tuple[int, float]]]:
    """The loss series of the TensorBoard event files of `train_dir`.

    Of `tags`, the one with the most points (the first in `tags` on a tie).

    Returns:
      ``(tag, [(step, value), ...])`` in the order they were written: after a rollback the
      steps start again from the checkpoint's.

    Raises:
      ValueError: No event file, or none of the tags in it.
    """
    import tensorflow as tf  # Local: only the plot needs it.

    files = sorted(tf.io.gfile.glob(_paths.join(train_dir, "events.out.tfevents.*")))
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
    found = [tag for tag in tags if series.get(tag)]
    if found:
        tag = max(found, key=lambda t: (len(series[t]), -found.index(t)))
        return tag, [(step, value) for _, step, value in sorted(series[tag])]
    raise ValueError(
        f"the event files of {train_dir} hold none of the scalars "
        f"{', '.join(tags)}; train with summaries on (save_summaries_steps) to "
        "plot the loss."
    )


def split_at_rollbacks(points: Sequence[Tuple[int, float]]) -> List[Tuple[List, List]]:
    """Splits a series written in order into ``(kept, dropped)`` runs.

    A step that does not exceed the one before starts a new run (a rollback went back). In
    each run, the points from that restart's step on were undone: ``dropped``. The point
    before them is in both, so that the lines join.
    """
    runs: List[List[Tuple[int, float]]] = []
    for point in points:
        if not runs or point[0] <= runs[-1][-1][0]:
            runs.append([])
        runs[-1].append(point)
    pieces = []
    for number, run in enumerate(runs):
        restart = runs[number + 1][0][0] if number + 1 < len(runs) else math.inf
        kept = [p for p in run if p[0] < restart]
        dropped = [p for p in run if p[0] >= restart]
        if kept and dropped:
            dropped = [kept[-1]] + dropped
        pieces.append((kept, dropped))
    return pieces


def plot_run(train_dir: str, out_path: str) -> str:
    """Draws the loss over steps with the bad steps, skips and rollbacks marked.

    Args:
      train_dir: The training directory.
      out_path: The image to write (``.png``).

    Returns:
      `out_path`.

    Raises:
      ImportError: matplotlib is not installed (install the ``plot`` extra).
      ValueError: No loss to plot.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ImportError(
            "--plot needs matplotlib, which is not installed; install it with "
            "pip install 'slim_nanguard[plot]' (or pip install matplotlib)."
        ) from err
    import tensorflow as tf  # Local, as elsewhere here.

    tag, points = read_scalars(train_dir)
    records = _record.read_events(train_dir)
    bad = [r.get("step", 0) for r in records if r.get("kind") == "bad_step"]
    if bad:  # The whole run, and a close look at the first bad step.
        figure, (whole, close) = plt.subplots(
            1, 2, figsize=(12, 4.5), gridspec_kw={"width_ratios": [2, 1]}
        )
        panels = [whole, close]
    else:
        figure, whole = plt.subplots(figsize=(9, 4.5))
        panels = [whole]
    for axes in panels:
        _draw(axes, tag, points, records)
    name = _paths.basename(_paths.absolute(train_dir).rstrip("/"))
    whole.set_title(f"{name}: the loss and the guard's events")
    whole.legend(loc="best", fontsize="small")
    if bad:
        close.set_xlim(max(bad[0] - 20, min(s for s, _ in points) - 1), bad[0] + 40)
        close.set_title(f"around the first bad step (global step {bad[0]})")
    figure.tight_layout()
    with tf.io.gfile.GFile(out_path, "wb") as f:  # A URL too (gs://...).
        figure.savefig(f, dpi=100, format=os.path.splitext(out_path)[1][1:] or None)
    plt.close(figure)
    return out_path


def _draw(axes, tag: str, points, records) -> None:
    """The loss (a dropped stretch grey), the bad steps and the rollbacks, on `axes`."""
    labels = set()

    def once(label):
        if label in labels:
            return None
        labels.add(label)
        return label

    for kept, dropped in split_at_rollbacks(points):
        if dropped:
            axes.plot(
                [s for s, _ in dropped],
                [v for _, v in dropped],
                color="0.6",
                lw=1.2,
                ls="--",
                label=once("dropped by a rollback"),
            )
        axes.plot(
            [s for s, _ in kept], [v for _, v in kept], color="tab:blue", lw=1.2, label=once(tag)
        )
    finite = [v for _, v in points if math.isfinite(v)]
    top = max(finite) if finite else 1.0
    if finite and min(finite) > 0 and top / min(finite) > 1e3:
        axes.set_yscale("log")  # a divergence spans orders of magnitude
    marks = {
        "skip": ("x", "tab:orange", "bad step, skipped"),
        "rollback": ("v", "tab:red", "bad step, rolled back"),
        "stop": ("s", "tab:purple", "bad step, stopped"),
        "raise": ("X", "black", "bad step, gave up"),
    }
    for r in records:
        if r.get("kind") == "bad_step":
            marker, color, label = marks.get(r.get("action"), marks["skip"])
            axes.scatter(
                [r.get("step", 0)], [top], marker=marker, color=color, zorder=3, label=once(label)
            )
        elif r.get("kind") == "rollback":
            axes.axvline(r.get("step", 0), color="tab:red", ls="--", lw=0.8, label=once("rollback"))
    axes.set_xlabel("global step")
    axes.set_ylabel(tag)
