"""The autopsy of a bad step: which op made the first non-finite value, and for which examples.

The guard is atomic, so the weights after a bad step are those that made it, and `_capture`
kept its batch: the replay (docs/guide.md) starts from both. Every failure goes into
`Autopsy.error`: an autopsy never takes training down.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import linecache
import math
import os
import sysconfig
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from slim_nanguard import _capture
from slim_nanguard import _log as logging
from slim_nanguard import _ops
from slim_nanguard import _paths
from slim_nanguard import _triage
from slim_nanguard._reasons import NON_FINITE

DUMP_DIRNAME = "nanguard_autopsy"
DEFAULT_TIMEOUT_SECS = 60.0
DEFAULT_MAX_CHUNK_BYTES = 64 << 20
# The weights the step read go into the dump (so that --replay needs nothing else) up to this.
MAX_DUMP_WEIGHT_BYTES = 64 << 20

_VARIABLE_READ_TYPES = frozenset({"ReadVariableOp", "VariableV2", "Variable"})
_SHAPE_TYPES = frozenset({"Shape", "ShapeN", "Size", "Rank"})
# Ops for which a 0 in an input (for the division ops, the divisor: input 1) is the usual cause.
_ZERO_INPUTS = {
    **dict.fromkeys(("Log", "Reciprocal", "Inv", "Rsqrt", "Pow", "Digamma", "Lgamma"), (0,)),
    **dict.fromkeys(
        ("Xdivy", "RealDiv", "Div", "FloorDiv", "TruncateDiv", "FloorMod", "Mod"), (1,)
    ),
}
# Ops for which a negative input (below -1 for Log1p) is the usual cause.
_NEGATIVE_INPUTS = {"Log": 0.0, "Sqrt": 0.0, "Rsqrt": 0.0, "Log1p": -1.0, "Pow": 0.0}
# Library code and our private modules, left out of an op's traceback: the user's builds the model.
_LIBRARY_PARTS = tuple(
    os.sep + part + os.sep
    for part in ("tensorflow", "tf_keras", "keras", "tf_slim", "absl", "numpy", "_pytest", "pluggy")
) + (os.sep + "slim_nanguard" + os.sep + "_",)
_STDLIB = sysconfig.get_paths().get("stdlib", "\0")
# The non-finite values a health dict counts: its key, the word for it, the test.
_NON_FINITE = (
    ("nan", "NaN", np.isnan),
    ("posinf", "+Inf", np.isposinf),
    ("neginf", "-Inf", np.isneginf),
)


class AutopsyError(Exception):
    """Why a replay could not go on (caught by `replay` into `Autopsy.error`)."""


@dataclasses.dataclass(frozen=True)
class Autopsy:
    """What the replay of one bad step found; a bad step's record holds its `to_json` (the
    fields are docs/guide.md's). ``reproduced`` is None when the replay failed first (``error``
    says why) and for a finite step a reason rejected (``cause``); ``first_bad_op`` has
    ``examples_at`` when the ``bad_examples`` are a later op's."""

    reproduced: Optional[bool] = None
    first_bad_op: Optional[Dict[str, Any]] = None
    bad_examples: Tuple[int, ...] = ()
    batch_size: int = 0
    dump: Optional[str] = None
    cost: Dict[str, Any] = dataclasses.field(default_factory=dict)
    error: Optional[str] = None
    step: int = -1
    cause: str = NON_FINITE
    top_examples: Tuple[Tuple[int, float], ...] = ()
    per_example_loss: Optional[str] = None
    median_loss: Optional[float] = None
    spike_over: Tuple[str, ...] = ()
    triage: Optional[Dict[str, Any]] = None  # `_triage.evidence`: chance, data or state.

    def to_json(self) -> Dict[str, Any]:
        """A JSON-ready dict: no NaN or Inf floats (each is its string, ``"inf"``)."""
        d = dict(dataclasses.asdict(self), summary=self.describe())
        # A numpy scalar as its Python value; anything else JSON lacks as its text.
        text = json.dumps(d, default=lambda v: v.item() if isinstance(v, np.generic) else str(v))
        return json.loads(text, parse_constant=lambda word: str(float(word)))

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "Autopsy":
        """The inverse of `to_json` (extra keys are ignored)."""
        kwargs = {f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d}
        for key in ("bad_examples", "spike_over"):
            kwargs[key] = tuple(kwargs.get(key) or ())
        # JSON keeps a non-finite float as a string ("inf"); float() reads it back.
        top = kwargs.get("top_examples") or ()
        kwargs["top_examples"] = tuple((int(i), float(loss)) for i, loss in top)
        if kwargs.get("median_loss") is not None:
            kwargs["median_loss"] = float(kwargs["median_loss"])
        return cls(**kwargs)

    @property
    def failed(self) -> bool:
        """Whether the replay itself failed (``error`` says why) rather than found something."""
        if self.cause == NON_FINITE:
            return self.reproduced is None
        return self.error is not None and not self.top_examples

    def describe(self) -> str:
        """One sentence for a log line or an error message."""
        told = explain_spike(self) if self.cause != NON_FINITE else explain(self)
        return "; ".join(filter(None, [told, _triage.sentence(self.triage)]))


# ---------------------------------------------------------------------- pure parts
def health(value: Any) -> Dict[str, Any]:
    """How finite an array (anything `np.asarray` takes) is: ``shape``, ``dtype``, ``size``,
    and for a numeric dtype the ``nan``, ``posinf``, ``neginf`` and ``zeros`` counts and
    ``finite_min`` / ``finite_max`` (None when none is finite)."""
    a = np.asarray(value)
    d = {"shape": list(a.shape), "dtype": str(a.dtype), "size": int(a.size)}
    if a.dtype.kind not in "fciubV":
        return d
    if a.dtype.kind == "V" or (a.dtype.kind in "fc" and a.dtype.itemsize < 4):
        a = a.astype(np.float32)  # bfloat16 (ml_dtypes) is kind "V".
    finite = a[np.isfinite(a)]
    d.update(
        {key: int(np.count_nonzero(test(a))) for key, _, test in _NON_FINITE},
        zeros=int(np.count_nonzero(a == 0)),
        finite_min=finite.min().item() if finite.size else None,
        finite_max=finite.max().item() if finite.size else None,
    )
    return d


def is_finite_health(h: Mapping[str, Any]) -> bool:
    """True when a `health` dict counts no NaN and no Inf."""
    return not non_finite_counts(h)


def non_finite_counts(h: Mapping[str, Any]) -> List[str]:
    """``["1 NaN", "2 -Inf"]``: the non-finite counts of a `health` dict that are not zero."""
    return [f"{h[key]} {word}" for key, word, _ in _NON_FINITE if h.get(key)]


def bad_rows(value: Any, batch_size: int) -> List[int]:
    """The indices along axis 0 whose rows hold NaN or Inf, ascending; empty when the array is
    not batch-major (its leading dimension is not `batch_size`) or all finite."""
    a = np.asarray(value)
    if batch_size <= 0 or a.ndim == 0 or a.shape[0] != batch_size or a.dtype.kind not in "fcV":
        return []
    if a.dtype.kind == "V":
        a = a.astype(np.float32)
    rows = ~np.isfinite(a.reshape(batch_size, -1)).all(axis=1)
    return [int(i) for i in np.flatnonzero(rows)]


def user_frames(frames: Sequence[Any], limit: int = 6) -> List[str]:
    """The innermost `limit` user's frames of ``op.traceback``'s `frames`, as ``file.py:42 in
    fn: code``; with no user frame at all, the innermost frame."""
    parsed = [(str(f[0]), int(f[1]), str(f[2])) for f in frames]
    mine = [f for f in parsed if not _is_library(f[0])] or parsed[-1:]
    return [
        ": ".join(filter(None, [f"{file}:{line} in {name}", linecache.getline(file, line).strip()]))
        for file, line, name in mine[-limit:]
    ]


def where(traceback_lines: Sequence[str]) -> str:
    """``file.py:42`` from the innermost line `user_frames` gave ('' if none)."""
    return os.path.basename(traceback_lines[-1].split(" in ", 1)[0]) if traceback_lines else ""


def explain(result: Autopsy) -> str:
    """The autopsy of a non-finite step in one sentence, such as ``first non-finite value:
    fc2/Log (Log) at model.py:42, input fc2/Softmax holds a 0; examples 3, 17 of the batch``."""
    first_bad_op, bad_examples, error = result.first_bad_op, result.bad_examples, result.error
    batch_size = result.batch_size
    if result.reproduced is False:
        return (
            "the replay of the step from the same weights and batch is finite: the bad "
            "step does not reproduce (nondeterminism such as dropout, or a transient "
            "fault), so the model is not to blame"
        )
    if first_bad_op is None:
        if error:
            return f"autopsy failed: {error}"
        return "the replay is not finite, but no single op could be named as the first"
    text = f"first non-finite value: {first_bad_op['name']} ({first_bad_op['type']})"
    text += f" at {first_bad_op['where']}" if first_bad_op.get("where") else ""
    text += f", {cause}" if (cause := _cause(first_bad_op)) else ""
    if batch_size and len(bad_examples) == batch_size:
        text += f"; all {batch_size} examples of the batch"
    elif bad_examples:
        shown = ", ".join(str(i) for i in list(bad_examples)[:10])
        more = f" and {len(bad_examples) - 10} more" if len(bad_examples) > 10 else ""
        noun = "example" if len(bad_examples) == 1 else "examples"
        text += f"; {noun} {shown}{more} of the batch"
    if bad_examples and first_bad_op.get("examples_at"):
        text += f" (from {first_bad_op['examples_at']} on)"
    return text + (f" ({error})" if error else "")


def _cause(op: Mapping[str, Any]) -> str:
    """What about the inputs of the first bad op explains it, as a clause."""
    inputs, outputs = op.get("inputs") or [], op.get("output") or []
    if not inputs:
        kinds = ", ".join(non_finite_counts(outputs[0])) if outputs else ""
        # An op of the batch itself: a non-finite value there was in the data.
        if op["type"] in _ops.BATCH_OP_TYPES:
            return f"the batch itself holds {kinds}" if kinds else "the batch itself"
        return f"which makes {kinds} from no float input" if kinds else ""
    for h in inputs:
        if not is_finite_health(h):
            return f"input {_short(h['name'])} holds {', '.join(non_finite_counts(h))}"
    for index in _ZERO_INPUTS.get(op["type"], ()):
        if index < len(inputs) and inputs[index].get("zeros"):
            return f"input {_short(inputs[index]['name'])} holds a 0"
    if op["type"] in _NEGATIVE_INPUTS:
        low = inputs[0].get("finite_min")
        if low is not None and low < _NEGATIVE_INPUTS[op["type"]]:
            return f"input {_short(inputs[0]['name'])} holds {low:.6g}"
    # Each input's finite value of largest magnitude, with its sign; the first largest of those.
    extremes = [max(h.get("finite_max") or 0, h.get("finite_min") or 0, key=abs) for h in inputs]
    largest = max(extremes, key=abs)
    return f"input {_short(inputs[extremes.index(largest)]['name'])} reaches {largest:.3g}"


def _short(tensor_name: str) -> str:
    """``fc2/Softmax`` for ``fc2/Softmax:0``: the op's name stands for its first output."""
    return tensor_name[:-2] if tensor_name.endswith(":0") else tensor_name


def _is_library(filename: str) -> bool:
    return any(part in filename for part in _LIBRARY_PARTS) or (
        filename.startswith(_STDLIB) and "site-packages" not in filename
    )


# ---------------------------------------------------------------------- the replay
@dataclasses.dataclass
class _Budget:
    clock: Callable[[], float]
    timeout_secs: float
    start: float = 0.0
    runs: int = 0
    peak_bytes: int = 0
    ops_checked: int = 0

    def check(self, what: str) -> None:
        spent = self.clock() - self.start
        if spent > self.timeout_secs:
            raise AutopsyError(
                f"gave up after {spent:.1f} s (timeout {self.timeout_secs:g} s), {what}"
            )

    def run(self, session: tf.compat.v1.Session, fetches: List, feeds: Dict) -> List:
        self.runs += 1
        values = session.run(fetches, feeds)
        moved = sum(np.asarray(v).nbytes for v in [*values, *feeds.values()])
        self.peak_bytes = max(self.peak_bytes, moved)
        return values

    def cost(self) -> Dict[str, Any]:
        counts = {k: getattr(self, k) for k in ("peak_bytes", "runs", "ops_checked")}
        return {"seconds": round(self.clock() - self.start, 4), **counts}


def replay(
    session: tf.compat.v1.Session,
    feeds: Mapping[Any, Any],
    targets: Sequence[Any],
    *,
    timeout_secs: float = DEFAULT_TIMEOUT_SECS,
    max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES,
    clock: Callable[[], float] = time.monotonic,
    step: int = -1,
    batch_size: Optional[int] = None,
    cause: str = NON_FINITE,
    spike_threshold: Optional[float] = None,
    spike_over: Sequence[str] = (),
) -> Autopsy:
    """Replays a step on `feeds` (tensor or name -> array) in `session`, whose variables hold
    the step's weights: the first non-finite op behind `targets` (the loss and the gradients),
    or a spike's examples (of the total loss, triaged against `spike_threshold` when given;
    `spike_over` is what the spike was caught on), within `timeout_secs` of `clock`, about
    `max_chunk_bytes` a run (else ``error``). Raises only what `session.run` raises."""
    budget = _Budget(clock=clock, timeout_secs=timeout_secs, start=clock())
    feeds = {_tensor(session.graph, t): np.asarray(v) for t, v in feeds.items()}
    targets = [_tensor(session.graph, t) for t in targets]
    if batch_size is None:  # The most common leading dimension.
        leading = [a.shape[0] for a in feeds.values() if a.ndim >= 1]
        batch_size = max(set(leading), key=leading.count) if leading else 0
    found: Dict[str, Any] = {}

    def outcome(fed):  # Of the targets, a chunk a run.
        chunks = _chunks(targets, batch_size, max_chunk_bytes)
        return _triage.worst(_triage.outcome(budget.run(session, c, fed)) for c in chunks)

    try:  # Before any run: a run that reaches an unkept input op would take a new batch.
        ops = _ops_to_check(targets, feeds)
        if cause != NON_FINITE:  # A reason's: finite, so the examples that carried it.
            found = _replay_spike(session, feeds, targets[0], budget, batch_size, spike_threshold)
        elif (same := outcome(feeds)) == "finite":
            found = {"reproduced": False}
        else:
            found["reproduced"] = True
            found.update(_first_bad_op(session, ops, feeds, budget, max_chunk_bytes, batch_size))
        if cause == NON_FINITE:
            found["triage"] = _triage.triage(outcome, feeds, same, found, batch_size)
    except AutopsyError as err:
        found["error"] = str(err)
    found.update(cost=budget.cost(), batch_size=batch_size, spike_over=tuple(spike_over))
    return Autopsy(step=step, cause=cause, **found)


def _tensor(graph, t):
    return graph.get_tensor_by_name(t) if isinstance(t, str) else t


def _is_float(tensor) -> bool:
    return tensor.dtype.base_dtype.is_floating


def _ops_to_check(targets: Sequence[Any], feeds: Mapping[Any, Any]) -> List[Any]:
    """The fetchable ops the targets read by data edges up to the fed ops, in topological order,
    that the batch, the weights or a stateful op reaches (a NaN constant, a mask, is on purpose:
    the first bad op lets it in). AutopsyError when a run of them would take a new batch."""
    why = takes_a_batch(targets, feeds)
    if why:
        raise AutopsyError(f"{why}, so it cannot be replayed without taking a new batch")
    fed_ops = {t.op for t in feeds}
    seen = list(_ops.walk([t.op for t in targets], control=False, stop=fed_ops.__contains__))
    varies = _reaching(  # What makes a value change from step to step.
        seen, lambda op: op in fed_ops or op.type in _VARIABLE_READ_TYPES or _is_stateful(op)
    )
    return [
        op
        for op, reached in varies.items()
        if reached
        and (
            op in fed_ops  # pylint: disable-next=protected-access
            or (op._control_flow_context is None and any(map(_is_float, op.outputs)))
        )
    ]


def takes_a_batch(fetches: Sequence[Any], feeds: Mapping[Any, Any]) -> str:
    """Why a run of `fetches` with `feeds` would take a batch from the input pipeline (or
    need an unfed placeholder), as a clause; "" when it would not. Every op the run runs
    counts: through control edges too, and an input op with one output fed runs for another."""
    for op in _ops.executed(fetches, feeds):
        if op.type not in _ops.BATCH_OP_TYPES - {"PlaceholderWithDefault"}:
            continue
        unkept = [t for t in op.outputs if t not in feeds]
        if len(unkept) == len(op.outputs):
            return f"the step reads {op.name} ({op.type}), which was not kept"
        if unkept:
            names = ", ".join(f"{t.name} ({t.dtype.base_dtype.name})" for t in unkept)
            return f"the step reads {op.name} ({op.type}), whose {names} was not kept"
        return f"the step runs {op.name} ({op.type}) through a control dependency"
    return ""


def _reaching(
    ops: Sequence[Any], source: Callable[[Any], bool], valueless: frozenset = _SHAPE_TYPES
) -> Dict[Any, bool]:
    """Each of `ops` (a walk back), in topological order -> whether a value a `source` op makes
    reaches it; a `valueless` input passes on none (fill(shape(x), nan) is a constant)."""
    order = {op: i for i, op in enumerate(ops[0].graph.get_operations())}
    reaches = {}
    for op in sorted(ops, key=order.get):
        reaches[op] = source(op) or any(
            reaches.get(t.op, False) for t in op.inputs if t.op.type not in valueless
        )
    return reaches


def _is_stateful(op) -> bool:
    try:
        return bool(op.op_def.is_stateful)
    except Exception:  # pylint: disable=broad-except  (an op without an OpDef)
        return False


def _estimate_bytes(op, batch_size: int) -> int:
    """The bytes of `op`'s float outputs (of a tensor: its own), unknown dimensions taken as
    `batch_size`."""
    total = 0
    for t in filter(_is_float, getattr(op, "outputs", [op])):
        dims = t.shape.as_list() if t.shape.rank is not None else [batch_size or 1]
        size = math.prod(d if d is not None else max(batch_size, 1) for d in dims)
        total += size * t.dtype.base_dtype.size
    return total


def _chunks(ops: Sequence[Any], batch_size: int, max_bytes: int) -> List[List[Any]]:
    chunks, current, size = [], [], 0
    for op in ops:
        estimate = _estimate_bytes(op, batch_size)
        if current and size + estimate > max_bytes:
            chunks.append(current)
            current, size = [], 0
        current.append(op)
        size += estimate
    return chunks + [current] if current else chunks


def _first_bad_op(session, ops, feeds, budget: _Budget, max_chunk_bytes: int, batch_size: int):
    """`_describe` of the first op with a non-finite output; AutopsyError when there is none."""
    fed = {t.op for t in feeds}
    for op in filter(fed.__contains__, ops):  # The batch first: a NaN in the data needs no run.
        budget.ops_checked += 1
        if any(not is_finite_health(health(feeds[t])) for t in op.outputs if t in feeds):
            return _describe(session, op, feeds, budget, batch_size)
    chunks = _chunks([op for op in ops if op not in fed], batch_size, max_chunk_bytes)
    for number, chunk in enumerate(chunks):
        budget.check(
            f"after checking {budget.ops_checked} of {len(ops)} ops (chunk {number + 1} "
            f"of {len(chunks)})"
        )
        fetches = [t for op in chunk for t in op.outputs if _is_float(t)]
        values = dict(zip(fetches, budget.run(session, fetches, feeds)))
        for index, op in enumerate(chunk):
            budget.ops_checked += 1
            if any(not is_finite_health(health(values[t])) for t in op.outputs if t in values):
                later = ((o.name, _bad_rows_of(o, values, batch_size)) for o in chunk[index + 1 :])
                downstream = next((found for found in later if found[1]), None)
                del values
                return _describe(session, op, feeds, budget, batch_size, downstream)
    raise AutopsyError(
        "the replay was not finite but no op checked one by one was: the step is "
        "nondeterministic, or its first non-finite value is inside a while loop or a cond"
    )


def _bad_rows_of(op, values, batch_size: int) -> List[int]:
    """The rows of the batch non-finite in any output of `op` that `values` holds, ascending."""
    return sorted({i for t in op.outputs if t in values for i in bad_rows(values[t], batch_size)})


def _describe(session, op, feeds, budget: _Budget, batch_size: int, downstream=None):
    """The `Autopsy` fields of first bad op `op` (a fed op's inputs would take a new batch);
    `downstream`'s ``(op name, rows)`` give the examples when its outputs are not batch-major."""
    inputs = [] if any(t in feeds for t in op.outputs) else list(filter(_is_float, op.inputs))
    outputs = [t for t in op.outputs if _is_float(t) or t in feeds]
    wanted = [t for t in inputs + outputs if t not in feeds]
    values = dict(zip(wanted, budget.run(session, wanted, feeds))) if wanted else {}
    values.update((t, feeds[t]) for t in inputs + outputs if t in feeds)
    try:
        traceback = list(op.traceback or ())
    except Exception:  # pylint: disable=broad-except  (an imported graph may have none)
        traceback = []
    frames = user_frames(traceback)
    described = {
        "name": op.name,
        "type": op.type,
        "where": where(frames),
        "traceback": frames,
        "inputs": [{"name": t.name, **health(values[t])} for t in inputs],
        "output": [{"name": t.name, **health(values[t])} for t in outputs],
    }
    examples = _bad_rows_of(op, values, batch_size)
    if not examples and downstream is not None:
        described["examples_at"], examples = downstream
    return {"first_bad_op": described, "bad_examples": tuple(examples)}


# ---------------------------------------------------------------------- in training
def autopsy_bad_step(
    session: tf.compat.v1.Session,
    capture: _capture.Capture,
    targets: Sequence[Any],
    *,
    step: int = -1,
    cause: str = NON_FINITE,
    **options: Any,
) -> Autopsy:
    """`run_autopsy` (`options` are its other keywords) on the batch the bad step kept in
    `capture`; never raises (but KeyboardInterrupt): a failure is the result's ``error``."""
    try:
        values = _capture.read_kept_batch(session, capture)
    except Exception as err:  # pylint: disable=broad-except  (never into training)
        return _failure(step, f"reading the kept batch failed: {error_line(err)}", cause=cause)
    return run_autopsy(session, capture.tensors, values, targets, step=step, cause=cause, **options)


def run_autopsy(
    session: tf.compat.v1.Session,
    batch_tensors: Sequence[Any],
    batch_values: Sequence[Any],
    targets: Sequence[Any],
    *,
    step: int = -1,
    cause: str = NON_FINITE,
    clock: Callable[[], float] = time.monotonic,
    dump_dir: Optional[str] = None,
    **options: Any,
) -> Autopsy:
    """`replay` (`options` are its other keywords: ``timeout_secs``, ``spike_over``...) on the
    values the bad step kept of `batch_tensors`, dumped (with the weights the step read, up to
    `MAX_DUMP_WEIGHT_BYTES`) to `dump_dir`'s ``nanguard_autopsy/`` unless it is None;
    never raises (but KeyboardInterrupt): a failure is logged and is ``error``."""
    start = clock()
    try:
        feeds = dict(zip(batch_tensors, batch_values))
        result = replay(session, feeds, targets, clock=clock, step=step, cause=cause, **options)
        if dump_dir:
            reads = variable_reads([_tensor(session.graph, t) for t in targets], feeds)
            small = sum(_estimate_bytes(t.op, 0) for t in reads) <= MAX_DUMP_WEIGHT_BYTES
            # Fed the batch too: a read made under a control dependency on it would take one.
            readable = small and not takes_a_batch(reads, feeds)
            weights = dict(zip(reads, session.run(reads, feeds))) if readable else {}
            path = write_dump(dump_dir, result, feeds, weights, targets)
            result = dataclasses.replace(result, dump=path)
        return result
    except Exception as err:  # pylint: disable=broad-except  (never into training)
        cost = {"seconds": round(clock() - start, 4)}
        return _failure(step, error_line(err), cause=cause, cost=cost)


def _failure(step: int, message: str, **fields) -> Autopsy:
    """Logs that the autopsy of `step` failed, and returns an `Autopsy` that says why."""
    logging.warning(
        "slim_nanguard: the autopsy of step %d failed (training goes on): %s", step, message
    )
    return Autopsy(error=message, step=step, **fields)


def error_line(err: BaseException) -> str:
    """``KeyError: the first line of its message`` (the type's name again when it has none)."""
    text = str(getattr(err, "message", "") or err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0] if text else type(err).__name__}"


def variable_reads(targets: Sequence[Any], feeds: Mapping[Any, Any]) -> List[Any]:
    """The tensors through which the targets read variables (what the step's weights are)."""
    fed_ops = {t.op for t in feeds}
    walk = _ops.walk(
        [t.op for t in targets],
        control=False,
        stop=lambda op: op in fed_ops or _is_variable_read(op),
    )
    reads = [t for op in walk if op not in fed_ops and _is_variable_read(op) for t in op.outputs]
    return sorted(filter(_is_float, reads), key=lambda t: t.name)


def _is_variable_read(op) -> bool:
    """A resource variable's read, or a reference variable's "read" Identity (a reference
    tensor cannot be fed), outside any control-flow context."""
    return op._control_flow_context is None and (  # pylint: disable=protected-access
        op.type in _VARIABLE_READ_TYPES
        or (op.type == "Identity" and bool(op.inputs) and op.inputs[0].dtype._is_ref_dtype)
    )


# ---------------------------------------------------------------------- the dump
def write_dump(
    dump_dir: str,
    result: Autopsy,
    feeds: Mapping[Any, Any],
    weights: Mapping[Any, Any],
    targets: Sequence[Any],
) -> str:
    """Writes ``step<N>.npz`` and ``step<N>.json``, and returns the JSON report's path. An
    existing dump of the step (a rollback can bring a step back) is kept: a ``-2``... suffix."""
    directory = _paths.join(dump_dir, DUMP_DIRNAME)
    tf.io.gfile.makedirs(directory)
    base = stem = _paths.join(directory, f"step{result.step}")
    suffix = 1
    while tf.io.gfile.exists(base + ".json"):
        suffix += 1
        base = f"{stem}-{suffix}"
    arrays, listed = {}, {}
    for prefix, kept in (("batch", feeds), ("weight", weights)):
        keys = [f"{prefix}_{i}" for i in range(len(kept))]
        arrays.update(zip(keys, map(np.asarray, kept.values())))
        listed[prefix] = [{"key": k, "tensor": getattr(t, "name", t)} for k, t in zip(keys, kept)]
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    with tf.io.gfile.GFile(base + ".npz", "wb") as f:
        f.write(buffer.getvalue())
    report = dict(
        result.to_json(),
        dump=base + ".json",
        batch=listed["batch"],
        weights=listed["weight"],
        targets=[getattr(t, "name", t) for t in targets],
        arrays=_paths.basename(base) + ".npz",
        written=time.time(),  # The order `remove_old_dumps` keeps them by.
    )
    with tf.io.gfile.GFile(base + ".json", "w") as f:
        json.dump(report, f, indent=1, sort_keys=True)
    return base + ".json"


def remove_old_dumps(dump_dir: str, keep_first: int, keep_last: int) -> List[Dict[str, Any]]:
    """Removes all but the first `keep_first` and the last `keep_last` dumps (by ``written``,
    then name) of `dump_dir`, and returns their ``{"dump": path, "step": step}``, oldest first."""
    directory = _paths.join(dump_dir, DUMP_DIRNAME)
    reports = tf.io.gfile.glob(_paths.join(directory, "step*.json"))
    if len(reports) <= keep_first + keep_last:
        return []
    dumps = []
    for path in reports:
        try:
            with tf.io.gfile.GFile(path, "r") as f:
                report = json.load(f)
        except (ValueError, tf.errors.OpError):  # Half written, or gone: not ours to judge.
            continue
        dumps.append((report.get("written", 0.0), path, report))
    dumps.sort(key=lambda d: d[:2])
    removed = []
    for _, path, report in dumps[keep_first : len(dumps) - keep_last]:
        arrays = [_paths.join(directory, report["arrays"])] if report.get("arrays") else []
        for doomed in arrays + [path]:
            with contextlib.suppress(tf.errors.NotFoundError):  # Another task removed it.
                tf.io.gfile.remove(doomed)
        removed.append({"dump": report.get("dump") or path, "step": report.get("step")})
    return removed


def read_dump(path: str) -> Tuple[Dict[str, Any], Dict[str, np.ndarray], Dict[str, np.ndarray]]:
    """``(report, batch, weights)`` of a `write_dump` from its JSON report (or ``.npz``): the
    batch and the weights the step read (empty if too big to keep) as tensor name -> array."""
    if path.endswith(".npz"):
        path = path[: -len(".npz")] + ".json"
    with tf.io.gfile.GFile(path, "r") as f:
        report = json.load(f)
    with tf.io.gfile.GFile(_paths.join(_paths.dirname(path), report["arrays"]), "rb") as f:
        arrays = io.BytesIO(f.read())
    with np.load(arrays) as data:
        batch, weights = (
            {e["tensor"]: data[e["key"]] for e in report.get(part, [])}
            for part in ("batch", "weights")
        )
    return report, batch, weights


# ---------------------------------------------------------------------- a spike's autopsy
# How many of a spike's examples an autopsy keeps, highest per-example loss first.
TOP_EXAMPLES = 5
# An example stands out of a spike's batch when its loss is this many times the next one's.
STAND_OUT_RATIO = 4.0
# How a spike's per-example losses and median are printed; `standing_out` judges these figures.
LOSS_FORMAT = ".4g"
# The words for a value a spike may be caught on (`_spike.COLUMNS`), in "the ... spike".
_SPIKE_VALUES = {"loss": "loss", "grad_norm": "gradient-norm"}
# Ops that pass a loss on unchanged, and those that add losses of one shape.
_LOSS_PASS_TYPES = frozenset({"Identity", "Cast"})
_LOSS_SUM_TYPES = frozenset({"AddN", "Add", "AddV2", "Sub"})
_LOSS_SCALE_TYPES = {"Mul": "mul", "RealDiv": "div", "Div": "div", "DivNoNan": "div_no_nan"}
# Ops whose output holds no value of their input, only its shape.
_LOSS_VALUELESS_TYPES = _SHAPE_TYPES | {"OnesLike", "ZerosLike"}
_MAX_LOSS_TERMS = 10_000


def per_example_values(
    split: Sequence[Any], whole: Sequence[float], batch_size: int
) -> Optional[np.ndarray]:
    """Each example's loss (float64): its elements' contributions in the `split` terms, summed
    and times `batch_size` (their mean is the batch's part of the loss); a term not batch-major
    joins `whole`. None when none is split, or one in `whole` carries more than the split ones."""
    rows, whole = [], [float(w) for w in whole]
    for contribution in split:
        c = np.asarray(contribution, dtype=np.float64)
        if batch_size > 0 and c.ndim >= 1 and c.shape[0] == batch_size:
            rows.append(c.reshape(batch_size, int(np.prod(c.shape[1:]))).sum(axis=1))
        else:
            whole.append(float(np.sum(c)))
    if not rows:
        return None
    per_example = np.sum(rows, axis=0)
    if whole and max(abs(w) for w in whole) > abs(float(per_example.sum())):
        return None
    return per_example * batch_size


def rank_examples(per_example: Any, k: int = TOP_EXAMPLES) -> List[Tuple[int, float]]:
    """The `k` ``(index, loss)`` pairs of highest loss (not NaN), highest first, ties by index."""
    a = np.asarray(per_example, dtype=np.float64).reshape(-1)
    order = [i for i in np.argsort(-a, kind="stable") if not np.isnan(a[i])]
    return [(int(i), float(a[i])) for i in order[:k]]


def median_loss(per_example: Any) -> Optional[float]:
    """The median of the losses that are not NaN, or None when there is none."""
    a = np.asarray(per_example, dtype=np.float64).reshape(-1)
    a = a[~np.isnan(a)]
    return float(np.median(a)) if a.size else None


def shown_loss(value: float) -> float:
    """A per-example loss (or median) as a spike's sentence prints it (`LOSS_FORMAT`)."""
    return float(format(value, LOSS_FORMAT))


def standing_out(
    top_examples: Sequence[Tuple[int, float]],
    median: Optional[float],
    ratio: float = STAND_OUT_RATIO,
) -> int:
    """How many of the `rank_examples` pairs carried the spike (docs/guide.md's rule)."""
    if median is None or not top_examples:
        return 0
    chain = np.array([shown_loss(loss) for _, loss in top_examples] + [shown_loss(median)])
    if np.isposinf(chain[0]):
        infinite = int(np.count_nonzero(np.isposinf(chain)))
        return infinite if infinite < len(chain) else 0
    if not chain[0] > 0:  # No loss above 0 (or a NaN): no ratio to judge by.
        return 0
    positive = chain > 0
    chain[~positive] = chain[positive].min() / ratio
    gaps = np.log(chain[:-1] / chain[1:])
    cut = int(np.argmax(gaps))
    return cut + 1 if gaps[cut] >= math.log(ratio) - 1e-12 else 0  # the bottom's step: equal


def explain_spike(result: Autopsy) -> str:
    """A spike's autopsy in one sentence (docs/guide.md quotes one): the examples
    `standing_out` picks, hedged when ``spike_over`` (what the spike was caught on) lacks
    ``"loss"``."""
    top, median, error = result.top_examples, result.median_loss, result.error
    if error and not top:
        return f"the autopsy of the spike failed: {error}"
    if result.per_example_loss is None or not top:
        return (
            "the loss cannot be split per example, so no example of the batch can be named "
            "as the spike's"
        )
    count, hedge = standing_out(top, median), _hedge(result.spike_over)
    (indices, losses), (others, figures) = _figures(top[:count]), _figures(top[count:])
    of = f" of {result.batch_size}" if result.batch_size else ""
    at_median = f"; batch median {median:{LOSS_FORMAT}}" if median is not None else ""
    note = f" ({error})" if error else ""
    if not count:
        ending = f"the losses name no example that may have carried the {hedge}"
        return (
            f"no example of the batch{of} stands out: the highest per-example losses are examples "
            f"{others} ({figures}{at_median}), so "
            + (ending if hedge else "the batch as a whole carried the spike")
            + note
        )
    # All shown stand out, but the batch has more: the figures cannot tell where the carriers end.
    if not others and result.batch_size > count:
        of += " and perhaps others with lower losses"
    plural = "s" if len(top) - count > 1 else ""
    rest = f"; next highest: example{plural} {others} at {figures}" if others else ""
    figures = f"(per-example loss {losses}{rest}{at_median})"
    one = count == 1
    if hedge:
        return (
            f"the example{'' if one else 's'} with the highest loss, which may have carried "
            f"the {hedge}, {'is example' if one else 'are examples'} {indices}{of} {figures}" + note
        )
    return f"example{'' if one else 's'} {indices}{of} carried the spike {figures}" + note


def _figures(examples: Sequence[Tuple[int, float]]) -> Tuple[str, str]:
    """``("3, 17", "812.3, 95.1")``: the indices and the losses of `examples`, as printed."""
    indices = ", ".join(str(i) for i, _ in examples)
    return indices, ", ".join(f"{loss:{LOSS_FORMAT}}" for _, loss in examples)


def _hedge(over: Sequence[str]) -> str:
    """``"gradient-norm spike (only the gradient norm was over spike_sigma)"`` when a spike was
    caught on values other than the loss alone (so its examples are a guess), else ``""``."""
    if not over or "loss" in over:
        return ""
    words = " and ".join(_SPIKE_VALUES.get(c, c) for c in over)
    verb = "was" if len(over) == 1 else "were"
    return f"{words} spike (only the {words.replace('-', ' ')} {verb} over spike_sigma)"


def _replay_spike(
    session, feeds, loss, budget: _Budget, batch_size: int, threshold: Optional[float] = None
) -> Dict[str, Any]:
    """The spike part of `replay`: the `Autopsy` fields of the examples that carried it, and
    with `threshold` its ``triage`` (`_triage.spike_triage`)."""
    found = find_per_example_loss(loss)
    if found is None:
        return {}
    terms, others = found
    budget.check("before fetching the per-example losses")
    fetches = list(dict.fromkeys(t for term in terms + others for t in term.fetches()))
    values = dict(zip(fetches, budget.run(session, fetches, feeds)))
    per_example = per_example_values(
        [term.contribution(values) for term in terms],
        [float(np.sum(term.contribution(values))) for term in others],
        batch_size,
    )
    if per_example is None:
        return {}
    top, median = tuple(rank_examples(per_example)), median_loss(per_example)
    result = {
        "top_examples": top,
        "per_example_loss": " + ".join(term.tensor.name for term in terms),
        "median_loss": median,
    }
    if threshold is not None:
        standing = [i for i, _ in top[: standing_out(top, median)]]
        result["triage"] = _triage.spike_triage(per_example, standing, threshold, feeds, batch_size)
    return result


@dataclasses.dataclass(frozen=True)
class _Term:
    """A tensor behind the total loss, through ops linear in it: each element's part of the
    total loss is its value times the scalar ``factors`` (a tensor or a number, and ``mul``,
    ``div`` or ``div_no_nan``), divided by the reduction ratio of each ``Mean`` in ``means``."""

    tensor: Any
    factors: Tuple[Tuple[Any, str], ...] = ()
    means: Tuple[Any, ...] = ()

    def through(self, tensor, factor=None, mean=None) -> "_Term":
        return _Term(
            tensor,
            self.factors + ((factor,) if factor is not None else ()),
            self.means + ((mean,) if mean is not None else ()),
        )

    def fetches(self) -> List[Any]:
        """The tensors the term's part of the loss is computed from."""
        factors = [f for f, _ in self.factors if not isinstance(f, float)]
        means = [t for op in self.means for t in (op.inputs[0], op.outputs[0])]
        return [self.tensor] + factors + means

    def contribution(self, values: Mapping[Any, Any]) -> np.ndarray:
        """Each element's part of the total loss (float64), from the fetched `values`."""
        part = np.asarray(values[self.tensor], dtype=np.float64)
        with np.errstate(divide="ignore", invalid="ignore"):
            for factor, kind in self.factors:
                f = float(np.asarray(values.get(factor, factor)))
                if kind == "mul":
                    part = part * f
                else:  # div_no_nan by 0 makes 0
                    part = part / f if kind == "div" or f != 0 else np.zeros_like(part)
            for op in self.means:
                ratio = np.size(values[op.inputs[0]]) / max(np.size(values[op.outputs[0]]), 1)
                part = part / ratio
        return part


def find_per_example_loss(loss: Any) -> Optional[Tuple[List[_Term], List[_Term]]]:
    """The per-example losses behind a total loss: back through linear ops (docs/guide.md) to
    the first batch-major float tensors, as ``(terms, others)``: those terms, and those that
    cannot be split. None if no term is, or over `_MAX_LOSS_TERMS` terms."""
    batch_ops = set(_ops.sources([loss.op], _ops.BATCH_OP_TYPES, control_inputs=False))
    seen = list(_ops.walk([loss.op], control=False, stop=batch_ops.__contains__))
    depends = _reaching(seen, batch_ops.__contains__, valueless=_LOSS_VALUELESS_TYPES)
    leading = {t.shape.as_list()[0] for op in batch_ops for t in op.outputs if t.shape.rank}
    batch_dim = leading.pop() if len(leading) == 1 else None
    terms, others, stack = [], [], [_Term(loss)]
    for _ in range(_MAX_LOSS_TERMS):  # A sum that reuses its terms over and over: give up.
        if not stack:
            break
        term = stack.pop()
        if not depends.get(term.tensor.op, False):
            continue  # A regularization loss, a constant: not the batch's.
        if (below := _terms_below(term, depends, batch_dim)) is not None:
            stack.extend(reversed(below))
        elif _is_float(term.tensor) and _batch_major(term.tensor, batch_dim):
            terms.append(term)
        else:
            others.append(term)
    if stack:
        return None
    return (terms, others) if terms else None


def _batch_major(tensor, batch_dim: Optional[int]) -> bool:
    """Whether `tensor`'s leading dimension may be the batch's: unknown, or `batch_dim`."""
    return bool(tensor.shape.rank) and tensor.shape.as_list()[0] in (None, batch_dim)


def _terms_below(term: _Term, depends: Mapping[Any, bool], batch_dim) -> Optional[List[_Term]]:
    """The terms `term` adds up from, through one linear op; None at any other op. A
    batch-major tensor is looked past only through an ``Identity``, a ``Cast`` or a scalar
    weighting (to name the examples' own loss); sums and reductions only above it."""
    tensor = term.tensor
    op, shape, inputs = tensor.op, tensor.shape, list(tensor.op.inputs)
    if op.type in _LOSS_PASS_TYPES and inputs and _is_float(inputs[0]):
        return [term.through(inputs[0])]
    if op.type in _LOSS_SCALE_TYPES and len(inputs) == 2:
        kind = _LOSS_SCALE_TYPES[op.type]
        a, b = inputs
        for value, scale in [(a, b), (b, a)] if kind == "mul" else [(a, b)]:
            if (  # The weighted term first, then its scalar weight.
                scale.shape.rank == 0
                and value.shape.is_compatible_with(shape)
                and depends.get(value.op, False)
                # Two scalars of the batch multiplied: which one is the loss?
                and not (kind == "mul" and value.shape.rank == 0 and depends.get(scale.op, False))
            ):
                return [term.through(value, factor=(scale, kind))]
        return None
    if _batch_major(tensor, batch_dim):
        return None
    if op.type in _LOSS_SUM_TYPES and all(t.shape == shape for t in inputs):
        below = [term.through(t) for t in inputs]
        if op.type == "Sub":
            below[1] = term.through(inputs[1], factor=(-1.0, "mul"))
        return below
    if op.type == "Neg":
        return [term.through(inputs[0], factor=(-1.0, "mul"))]
    if op.type in ("Sum", "Mean") and _is_float(inputs[0]):
        return [term.through(inputs[0], mean=op if op.type == "Mean" else None)]
    return None
