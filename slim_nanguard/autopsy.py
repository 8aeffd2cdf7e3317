"""Reading a run's autopsies after the fact: what ``slim-nanguard-autopsy TRAIN_DIR`` does.

`find_bad_step` picks a bad step's record, `format_report` renders it, `replay_dump` replays
the step from its dump on any machine (the command's plot is `slim_nanguard.app.plot`'s).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Mapping, Optional

import tensorflow as tf

from slim_nanguard import _autopsy
from slim_nanguard import _checkpoints
from slim_nanguard import _exact_sums
from slim_nanguard import _paths
from slim_nanguard import _recorders
from slim_nanguard._reasons import NON_FINITE


def find_bad_step(train_dir: str, step: Optional[int] = None) -> Dict[str, Any]:
    """The last record of the bad step of `train_dir` at global `step`; None picks the latest
    bad step that has an autopsy, else the latest. The record gets ``dump_removed`` (the
    removal's record) when its autopsy dump was removed since.

    Raises:
      ValueError: No bad step recorded, or none at `step` (the message lists those there are).
    """
    events = _recorders.read_events(train_dir)
    records = [r for r in events if r.get("kind") == "bad_step"]
    path = _paths.join(train_dir, _recorders.EVENTS_FILENAME)
    if not records:
        where = (
            path if tf.io.gfile.exists(path) else f"{train_dir} (no {_recorders.EVENTS_FILENAME})"
        )
        raise ValueError(f"no bad step recorded in {where}: nothing to show.")
    if step is None:
        record = ([r for r in records if r.get("autopsy")] or records)[-1]
    else:
        matching = [r for r in records if r.get("step") == step]
        if not matching:
            known = ", ".join(str(s) for s in sorted({r.get("step") for r in records}))
            raise ValueError(
                f"no bad step {step} in {path}; the bad steps recorded are at global step {known}."
            )
        record = matching[-1]
    dump = (record.get("autopsy") or {}).get("dump")
    removed = [
        r for r in events if r.get("kind") == "autopsy_dump_removed" and r.get("dump") == dump
    ]
    return dict(record, dump_removed=removed[-1]) if dump and removed else record


def format_report(record: Mapping[str, Any]) -> str:
    """A few lines on one bad step (its `find_bad_step` record) and its autopsy."""
    lines = [
        f"bad step at global step {record.get('step')} ({record.get('mode')} mode): loss "
        f"{record.get('loss')} ({record.get('loss_kind')}), action {record.get('action')}"
    ]
    if record.get("why"):  # A step a reason rejected: what its log line said of it.
        lines.append(f"  rejected    {record['why']}")
    if record.get("culprits"):
        culprits, kinds = record["culprits"], record.get("culprit_kinds") or []
        held = f" ({_exact_sums.describe(list(zip(culprits, kinds)))})" if kinds else ""
        lines.append(f"  culprits    non-finite gradients of {', '.join(culprits)}{held}")
    if not record.get("autopsy"):
        lines.append("  autopsy     none (autopsies off, or past autopsy_max_steps)")
        return "\n".join(lines)
    result = with_spike_over(_autopsy.Autopsy.from_json(record["autopsy"]), record)
    lines.append(f"  autopsy     {result.describe()}")
    lines += _spike_example_lines(result) + _first_bad_op_lines(result)
    if result.dump:
        removed = record.get("dump_removed") or {}
        later = (
            f", removed later: a directory keeps the first {removed.get('keep_first')} and the "
            f"latest {removed.get('keep_last')} dumps"
        )
        lines.append(f"  dump        {result.dump}{later if removed else ''}")
    if cost := result.cost:
        lines.append(
            f"  cost        {cost.get('seconds', 0):.3g} s, {cost.get('runs', '?')} "
            f"run{'' if cost.get('runs') == 1 else 's'}, at most {cost.get('peak_bytes', 0)} "
            "bytes fetched at once"
        )
    return "\n".join(lines)


def _spike_example_lines(result: _autopsy.Autopsy) -> List[str]:
    """A spike's examples in the report: the per-example loss, the highest losses first."""
    if not result.top_examples:
        return []
    median = result.median_loss
    return [
        f"  per example {result.per_example_loss}",
        "  highest     "
        + ", ".join(f"example {i}: {loss:.6g}" for i, loss in result.top_examples)
        + (f" (batch of {result.batch_size}" if result.batch_size else " (batch")
        + (f", median {median:.6g})" if median is not None else ")"),
    ]


def _first_bad_op_lines(result: _autopsy.Autopsy) -> List[str]:
    """The first non-finite op in the report: where it was built, its inputs and output, and
    the examples of the batch behind it."""
    op, lines = result.first_bad_op, []
    if op:
        lines.append(f"  op          {op['name']} ({op['type']})")
        for number, frame in enumerate(op.get("traceback") or []):
            lines.append(f"  {'built at' if number == 0 else '':<12}{frame}")
        lines += [f"  input       {describe_health(h)}" for h in op.get("inputs") or []]
        lines += [f"  output      {describe_health(h)}" for h in op.get("output") or []]
    if examples := result.bad_examples:
        shown = _exact_sums.listed([str(i) for i in examples], 20)
        if len(examples) == result.batch_size:
            shown = f"all {len(examples)}"
        at = f", from {op['examples_at']} on" if op and op.get("examples_at") else ""
        lines.append(f"  examples    {shown} (of {result.batch_size} in the batch{at})")
    return lines


def with_spike_over(result: _autopsy.Autopsy, record: Mapping[str, Any]) -> _autopsy.Autopsy:
    """`result`, with ``spike_over`` filled from `record`'s ``spike.over`` when empty."""
    over = (record.get(str(record.get("cause"))) or {}).get("over")
    if result.cause == NON_FINITE or result.spike_over or not over:
        return result
    return dataclasses.replace(result, spike_over=tuple(over))


def describe_health(h: Mapping[str, Any]) -> str:
    """``name [6] float32: 1 -Inf, 1 zero, finite in [0, 5.17]`` for a health dict."""
    counts = _autopsy.non_finite_counts(h)
    if h.get("zeros"):
        counts.append(f"{h['zeros']} zero{'s' if h['zeros'] > 1 else ''}")
    low, high = h.get("finite_min"), h.get("finite_max")
    span = f"finite in [{low:.6g}, {high:.6g}]" if None not in (low, high) else "no finite value"
    shape = "x".join(str(d) for d in h.get("shape") or []) or "scalar"
    return f"{h.get('name', '?')} [{shape}] {h.get('dtype', '')}: {', '.join(counts + [span])}"


def replay_dump(
    dump_path: str, train_dir: str, *, timeout_secs: float = _autopsy.DEFAULT_TIMEOUT_SECS
) -> _autopsy.Autopsy:
    """Replays a bad step offline, within `timeout_secs`: restores `train_dir`'s latest
    checkpoint in its meta graph and feeds the batch of the dump `dump_path` (the record's
    ``autopsy.dump``) and, when the dump holds them, the weights the step read. Returns the
    replay's `Autopsy` (``error`` says if it could not be done).

    Raises:
      ValueError: No meta graph (``*.meta``) in `train_dir`, or no such dump.
      UnreadableCheckpointError: A file of the latest checkpoint is missing, cut short or garbled.
    """
    if not tf.io.gfile.exists(dump_path):
        raise ValueError(
            f"the dump {dump_path} does not exist (was the run's directory "
            "moved? pass the directory the dump sits in)."
        )
    report, batch, weights = _autopsy.read_dump(dump_path)
    checkpoint = _checkpoints.latest_checkpoint(train_dir)
    if checkpoint and tf.io.gfile.exists(checkpoint + ".index"):
        _checkpoints.non_finite_variables(checkpoint)  # Raises if it cannot be read.
    meta = f"{checkpoint}.meta"
    if not checkpoint or not tf.io.gfile.exists(meta):  # Else the directory's last one.
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
    step, cause = int(report.get("step", -1)), report.get("cause", NON_FINITE)
    with tf.compat.v1.Session(graph=graph) as sess:
        try:
            if checkpoint and saver is not None:
                saver.restore(sess, checkpoint)
            result = _autopsy.replay(
                sess,
                {**batch, **weights},
                report["targets"],
                timeout_secs=timeout_secs,
                step=step,
                batch_size=int(report.get("batch_size") or 0) or None,
                cause=cause,
                spike_over=report.get("spike_over") or (),
            )
        except (KeyError, ValueError, tf.errors.OpError) as err:
            return _autopsy.Autopsy(step=step, cause=cause, error=_autopsy.error_line(err))
    # What the dump knows: what the spike was caught on, the first bad op's traceback (an
    # imported graph has none), and whether the replay read the checkpoint's weights.
    op, recorded = result.first_bad_op, report.get("first_bad_op") or {}
    if op is not None and not op.get("traceback") and recorded.get("name") == op["name"]:
        op = dict(op, traceback=recorded.get("traceback", []), where=recorded.get("where", ""))
        result = dataclasses.replace(result, first_bad_op=op)
    if not weights:
        note = (
            f"the dump holds no weights (too big to keep): replayed with {checkpoint}, "
            "which may predate the bad step"
        )
        result = dataclasses.replace(result, error="; ".join(filter(None, [result.error, note])))
    return result
