"""Triage of a bad step by replay (issue 35): the verdict ``chance``, ``data`` or ``state``
and its evidence, decided by pure functions from the replays' outcomes."""

import hashlib
import math
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

CHANCE, DATA, STATE = "chance", "data", "state"

# A component as the fingerprint sees it: (dtype name, the shape of one example).
Spec = Tuple[str, Tuple[int, ...]]


def fingerprint(components: Sequence[Any]) -> str:
    """The fingerprint of one example given as its `components` (arrays or scalars, in order):
    12 hex digits of the sha1 of their bytes, a numeric array's as laid out in C order, strings
    length-prefixed."""
    h = hashlib.sha1()
    for component in components:
        # A bytes scalar as an object array: numpy's fixed-width bytes drop trailing NULs.
        text = isinstance(component, (bytes, str))
        array = np.array(component, dtype=object) if text else np.asarray(component)
        if array.dtype.kind not in "OSU":
            h.update(np.ascontiguousarray(array).tobytes())
            continue
        for item in array.ravel().tolist():
            item = item if isinstance(item, bytes) else str(item).encode()
            h.update(len(item).to_bytes(8, "little") + item)
    return h.hexdigest()[:12]


def spec_of(array: np.ndarray) -> Spec:
    """What the fingerprint sees of a component of one example: its dtype and its shape."""
    array = np.asarray(array)
    dtype = "string" if array.dtype.kind in "OSU" else array.dtype.name
    return dtype, tuple(int(d) for d in array.shape)


def outcome(values: Sequence[Any]) -> str:
    """``finite``, ``NaN`` or ``Inf``: a run's fetched `values` (NaN wins over Inf)."""
    arrays = [np.asarray(v) for v in values]
    arrays = [a for a in arrays if np.issubdtype(a.dtype, np.inexact)]
    if any(np.isnan(a).any() for a in arrays):
        return "NaN"
    return "Inf" if any(np.isinf(a).any() for a in arrays) else "finite"


def worst(outcomes: Iterable[str]) -> str:
    """The worst of `outcome`'s answers: NaN, then Inf, then finite."""
    return min(outcomes, key=("NaN", "Inf", "finite").index, default="finite")


def without_rows(
    feeds: Mapping[Any, np.ndarray], rows: Sequence[int], batch_size: int
) -> Tuple[Dict[Any, np.ndarray], Optional[int]]:
    """`feeds` with `rows` removed from each array whose leading dimension is `batch_size`
    (the others are fed as they are), and None; where a fed tensor's batch dimension is fixed
    in the graph, `rows` are instead filled with a copy of the first other row, returned."""
    keep = [i for i in range(batch_size) if i not in set(rows)]
    shapes = [t.shape for t in feeds if hasattr(t, "shape")]  # Of tensors, not of names.
    fixed = any(s.rank and s[0] == batch_size for s in shapes)
    index = [i if i in keep else keep[0] for i in range(batch_size)] if fixed else keep
    fed = {
        t: (a[index] if a.ndim >= 1 and a.shape[0] == batch_size else a) for t, a in feeds.items()
    }
    return fed, (keep[0] if fixed else None)


def identify(feeds: Mapping[Any, np.ndarray], rows: Sequence[int], batch_size: int) -> Dict:
    """What the quarantine needs to know `rows` of the batch again: their ``fingerprints``
    (`fingerprint` across the batch-major arrays of `feeds`, in the iterator's order: by op,
    then output index, so that the same example is named the same in another batch), the
    ``components`` hashed (each array's ``tensor``, ``dtype`` and example ``shape``, in order),
    and the ``ids`` of each row: its scalar integer and string components (an id, an index)."""

    def order(name: str) -> Tuple[str, int]:
        op, _, index = name.rpartition(":")
        return (op, int(index)) if op and index.isdigit() else (name, 0)

    named = [(str(getattr(t, "name", t)), np.asarray(a)) for t, a in feeds.items()]
    batch = [(n, a) for n, a in named if a.ndim >= 1 and a.shape[0] == batch_size]
    batch.sort(key=lambda na: order(na[0]))
    ids = {}
    for i in rows:
        scalars = {
            name: (a[i].decode(errors="replace") if isinstance(a[i], bytes) else a[i].item())
            for name, a in batch
            if a.ndim == 1 and (a.dtype.kind in "iu" or isinstance(a[i], bytes))
        }
        if scalars:
            ids[str(int(i))] = scalars
    specs = [(name, *spec_of(a[0])) for name, a in batch]
    return {
        "fingerprints": {str(int(i)): fingerprint([a[i] for _, a in batch]) for i in rows},
        "components": [{"tensor": n, "dtype": d, "shape": list(s)} for n, d, s in specs],
        "ids": ids,
    }


def verdict(
    reproduced: Optional[bool],
    bad_examples: Sequence[int],
    batch_size: int,
    without_outcome: Optional[str],
    in_batch: bool = False,
) -> Optional[str]:
    """The verdict from the replay of the same batch (`reproduced`; None when it failed) and
    the run without `bad_examples` (`without_outcome`, None when not run, else its `outcome` or
    why it failed): ``chance`` when the replay is finite, ``data`` when the batch without those
    rows is, or when the batch itself holds the first non-finite value (`in_batch`) and no
    row stands out (every row holds it, or a part of the batch that is no row's does);
    ``state`` when it is not or no row stands out (none, or all of `batch_size`); None when
    the replay or that run failed."""
    if reproduced is None:
        return None
    if not reproduced:
        return CHANCE
    if not bad_examples or len(bad_examples) >= batch_size:  # No row stands out.
        return DATA if in_batch else STATE  # data: the batch itself holds NaN or Inf.
    if without_outcome not in ("finite", "NaN", "Inf"):
        return None  # The run without the rows failed: nothing to decide from.
    return DATA if without_outcome == "finite" else STATE


def evidence(
    reproduced: Optional[bool],
    same_outcome: Optional[str],
    bad_examples: Sequence[int],
    batch_size: int,
    without_outcome: Optional[str],
    prints: Mapping[int, str],
    in_batch: bool = False,
) -> Dict[str, Any]:
    """The JSON-safe ``triage`` record: ``verdict``, the ``runs`` (what was fed, the outcome),
    the ``examples`` with their ``fingerprints``, and ``in_batch`` when the batch itself held
    the first non-finite value."""
    runs = [{"fed": "same batch", "outcome": same_outcome}]
    if without_outcome is not None:
        runs.append({"fed": "without rows", "rows": list(bad_examples), "outcome": without_outcome})
    return {
        "verdict": verdict(reproduced, bad_examples, batch_size, without_outcome, in_batch),
        "runs": runs,
        "examples": [int(i) for i in bad_examples],
        "fingerprints": {str(i): p for i, p in prints.items()},
        **({"in_batch": True} if in_batch else {}),
    }


def spike_threshold(figures: Optional[Mapping[str, Any]]) -> Optional[float]:
    """The highest data loss the spike test that rejected a step with `figures` lets through:
    its z-score rule solved for the loss (the deviation it used is ``(log(loss) - log_mean) /
    z``); None when the spike was not caught on the loss."""
    if not figures:
        return None
    loss, mean = figures.get("loss"), figures.get("log_mean_loss")
    z, sigma = figures.get("z_loss"), figures.get("sigma")
    if None in (loss, mean, z, sigma) or not (loss > 0 and z > sigma):
        return None
    return math.exp(mean + sigma * (math.log(loss) - mean) / z)


def spike_triage(
    per_example: np.ndarray,
    standing: Sequence[int],
    threshold: float,
    feeds: Mapping[Any, np.ndarray],
    batch_size: int,
) -> Dict[str, Any]:
    """The triage of a spike from the replay's `per_example` losses (their mean is the data
    loss the spike test judged) and the rows `standing` out: ``chance`` when the replay's loss
    is within `threshold` (`spike_threshold`), ``data`` when the batch without those rows is,
    ``state`` when it is not or no row stands out. The loss without the rows is the mean of
    the others' (no extra run)."""
    a = np.asarray(per_example, dtype=np.float64)
    loss, rows = float(np.mean(a)), [int(i) for i in standing]
    runs: List[Dict[str, Any]] = [{"fed": "same batch", "loss": loss, "threshold": threshold}]
    verdict_ = CHANCE if loss <= threshold else STATE
    if verdict_ == STATE and rows and len(rows) < batch_size:
        without = float(np.mean(np.delete(a, rows)))
        runs.append({"fed": "without rows", "rows": rows, "loss": without})
        verdict_ = DATA if without <= threshold else STATE
    found = {"verdict": verdict_, "runs": runs, "examples": rows if verdict_ != CHANCE else []}
    return found | (identify(feeds, rows, batch_size) if found["examples"] else {})


def _spike_sentence(triage: Mapping[str, Any]) -> str:
    """`sentence` of a spike's triage, its losses against the spike test's threshold."""
    v, runs = triage["verdict"], triage["runs"]
    same, threshold = runs[0]["loss"], runs[0]["threshold"]
    limit = f"the spike threshold {threshold:.4g}"
    if v == CHANCE:
        return f"triage: chance — the replay's loss {same:.4g} is within {limit}"
    if len(runs) == 1:  # No example stands out (or every one does): the batch as a whole.
        which = "every example" if triage.get("examples") else "no example"
        return f"triage: state — the replay's loss {same:.4g} is over {limit}; {which} stood out"
    rows = ", ".join(str(i) for i in triage["examples"])
    noun = "example" if len(triage["examples"]) == 1 else "examples"
    without = runs[-1]["loss"]
    if v == DATA:
        prints = ", ".join(triage["fingerprints"][str(i)] for i in triage["examples"])
        return (
            f"triage: data — without {noun} {rows} the batch's loss is {without:.4g}, within "
            f"{limit} (fingerprints {prints})"
        )
    return f"triage: state — without {noun} {rows} the batch's loss is {without:.4g}, over {limit}"


def sentence(triage: Optional[Mapping[str, Any]]) -> str:
    """One sentence for a log line: the verdict and the numbers behind it ("" for none)."""
    if not triage or not triage.get("verdict"):
        return ""
    v, runs = triage["verdict"], triage.get("runs") or []
    if runs and "threshold" in runs[0]:
        return _spike_sentence(triage)
    if v == CHANCE:
        return "triage: chance — the replay of the same batch on the same weights is finite"
    rows = ", ".join(str(i) for i in triage.get("examples") or ())
    noun = "example" if len(triage.get("examples") or ()) == 1 else "examples"
    if runs and "filled_with_row" in runs[-1]:  # The batch dimension is fixed in the graph.
        rows += f" (filled with copies of example {runs[-1]['filled_with_row']})"
    if v == DATA:
        prints = [(triage.get("fingerprints") or {}).get(str(i), "?") for i in triage["examples"]]
        if len(runs) == 1 and not prints:  # In a part of the batch that is no row's.
            return "triage: data — the batch itself holds NaN or Inf, in no one example's row"
        if len(runs) == 1:  # Every example of the batch itself holds NaN or Inf.
            more = f" and {len(prints) - 3} more" if len(prints) > 3 else ""
            return (
                f"triage: data — the batch itself holds NaN or Inf in all {len(prints)} "
                f"examples (fingerprints {', '.join(prints[:3])}{more})"
            )
        prints = ", ".join(prints)
        return f"triage: data — the batch without {noun} {rows} is finite (fingerprints {prints})"
    if len(runs) > 1:
        return f"triage: state — the batch without {noun} {rows} is still {runs[-1]['outcome']}"
    return f"triage: state — the replay is {runs[0]['outcome']} and no example stands out"


def triage(
    run: Callable[[Dict[Any, np.ndarray]], str],
    feeds: Dict[Any, np.ndarray],
    same: str,
    found: Mapping[str, Any],
    batch_size: int,
) -> Dict[str, Any]:
    """The `evidence` of a replay whose first run's `outcome` was `same` and that `found`
    ``reproduced`` and ``bad_examples``: `run` (the replay's fetches, no new batch, no write;
    returns their `outcome`) runs once more on `feeds` without those rows when some but not
    all stand out."""
    reproduced, rows = found.get("reproduced"), tuple(found.get("bad_examples") or ())
    first = (found.get("first_bad_op") or {}).get("name")
    in_batch = any(getattr(t, "op", None) is not None and t.op.name == first for t in feeds)
    without, filled = None, None
    if reproduced and rows and len(rows) < batch_size:
        fed, filled = without_rows(feeds, rows, batch_size)
        try:
            without = run(fed)
        except (ValueError, tf.errors.OpError) as err:
            without = f"failed: {str(err).splitlines()[0][:200]}"
    # What the quarantine needs to know an example again: its fingerprint, components and ids.
    known = identify(feeds, rows, batch_size) if rows else {}
    prints = known.pop("fingerprints", {})
    found = evidence(reproduced, same, rows, batch_size, without, prints, in_batch) | known
    if filled is not None:  # The batch dimension is fixed in the graph: rows refilled.
        found["runs"][-1]["filled_with_row"] = filled
    return found
