"""Issue 35, first slice: the triage verdict's pure parts (no graph)."""

import hashlib
import math

import numpy as np
import pytest
import tensorflow as tf
import test_autopsy as ta

from slim_nanguard import _autopsy
from slim_nanguard import _triage
from slim_nanguard import quarantine

import nanguard_testlib as lib


@pytest.mark.parametrize(
    "reproduced, examples, size, without, expected",
    [
        (None, (), 8, None, None),
        (False, (), 8, None, "chance"),
        (True, (3,), 8, "finite", "data"),
        (True, (3, 7), 8, "NaN", "state"),
        (True, (3,), 8, "Inf", "state"),
        (True, (), 8, None, "state"),
        (True, tuple(range(8)), 8, None, "state"),
    ],
)
def test_verdict(reproduced, examples, size, without, expected):
    assert _triage.verdict(reproduced, examples, size, without) == expected


def test_outcome_names_nan_before_inf_and_ignores_ints():
    assert _triage.outcome([np.ones(3), np.int64(7)]) == "finite"
    assert _triage.outcome([np.array([1.0, np.inf])]) == "Inf"
    assert _triage.outcome([np.array([np.inf]), np.array([np.nan])]) == "NaN"


def test_without_rows_drops_rows_of_batch_arrays_only():
    x, y, lr = np.arange(12.0).reshape(4, 3), np.arange(4), np.float32(0.1)
    feeds = {"x": x, "y": y, "lr": lr, "w": np.zeros(3)}
    fed, filled = _triage.without_rows(feeds, [1, 2], 4)
    np.testing.assert_array_equal(fed["x"], x[[0, 3]])
    np.testing.assert_array_equal(fed["y"], [0, 3])
    assert fed["lr"] == lr and fed["w"].shape == (3,) and filled is None


def test_a_batch_dimension_fixed_in_the_graph_gets_the_rows_refilled():
    with tf.Graph().as_default():
        fixed, free = (
            tf.compat.v1.placeholder(tf.float32, [4, 3]),
            tf.compat.v1.placeholder(tf.int32, [None]),
        )
    x, y = np.arange(12.0).reshape(4, 3), np.arange(4)
    fed, filled = _triage.without_rows({fixed: x, free: y}, [0, 2], 4)
    assert filled == 1
    np.testing.assert_array_equal(fed[fixed], x[[1, 1, 1, 3]])
    np.testing.assert_array_equal(fed[free], [1, 1, 1, 3])


def test_fingerprints_are_the_example_bytes_across_batch_tensors():
    x, y = np.arange(12.0).reshape(4, 3), np.arange(4)
    prints = _triage.identify({"y": y, "x": x}, [2], 4)["fingerprints"]
    expected = hashlib.sha1(x[2].tobytes() + y[2].tobytes()).hexdigest()[:12]
    assert prints == {"2": expected}
    # The same example elsewhere in another batch has the same fingerprint.
    moved = _triage.identify({"x": x[[2, 0]], "y": y[[2, 0]]}, [0], 2)["fingerprints"]
    assert moved == {"0": expected}
    assert _triage.identify({"x": x, "y": y}, [1], 4)["fingerprints"]["1"] != expected


def test_sentences_state_their_numbers():
    data = _triage.evidence(True, "NaN", (3, 7), 8, "finite", {3: "ab12", 7: "cd34"})
    assert data["verdict"] == "data"
    assert data["runs"] == [
        {"fed": "same batch", "outcome": "NaN"},
        {"fed": "without rows", "rows": [3, 7], "outcome": "finite"},
    ]
    assert _triage.sentence(data) == (
        "triage: data — the batch without examples 3, 7 is finite (fingerprints ab12, cd34)"
    )
    state = _triage.evidence(True, "Inf", (5,), 8, "NaN", {5: "ef56"})
    assert _triage.sentence(state) == "triage: state — the batch without example 5 is still NaN"
    every = _triage.evidence(True, "Inf", (), 8, None, {})
    assert _triage.sentence(every) == (
        "triage: state — the replay is Inf and no example stands out"
    )
    chance = _triage.evidence(False, "finite", (), 8, None, {})
    assert _triage.sentence(chance) == (
        "triage: chance — the replay of the same batch on the same weights is finite"
    )
    assert (
        _triage.sentence(None)
        == ""
        == _triage.sentence(_triage.evidence(None, None, (), 8, None, {}))
    )


# ---------------------------------------------------------------------- stories of a training run
def _verdict_of_the_first_bad_step(logdir, model):
    assert ta._train(logdir, model, steps=3).bad_steps >= 1
    record = ta._bad_steps(logdir)[0]
    autopsy = _autopsy.Autopsy.from_json(record["autopsy"])
    assert autopsy.triage == record["autopsy"]["triage"]  # It round-trips through the record.
    return record["autopsy"], autopsy


@lib.each_mode
def test_a_transient_fault_is_chance(tmp_path, mode):
    model = ta._Model(mode, extra_loss=ta._nan_on_first_call_only())
    record, autopsy = _verdict_of_the_first_bad_step(tmp_path, model)
    assert autopsy.triage["verdict"] == "chance"
    assert autopsy.triage["runs"] == [{"fed": "same batch", "outcome": "finite"}]
    assert record["summary"].endswith(
        "triage: chance — the replay of the same batch on the same weights is finite"
    )


@lib.each_mode
def test_one_bad_example_is_data_named_with_its_fingerprint(tmp_path, mode):
    model = ta._Model(mode, fault="log_of_zero")
    record, autopsy = _verdict_of_the_first_bad_step(tmp_path, model)
    row = ta._batches("log_of_zero")[ta.BAD_BATCH][3]
    fingerprint = hashlib.sha1(row.tobytes()).hexdigest()[:12]
    assert autopsy.triage == {
        "verdict": "data",
        "runs": [
            {"fed": "same batch", "outcome": "NaN"},
            {"fed": "without rows", "rows": [3], "outcome": "finite", "filled_with_row": 0},
        ],
        "examples": [3],
        "fingerprints": {"3": fingerprint},
        # What the quarantine hashed (the one batch tensor), and no id: the batch has none.
        "components": [{"tensor": "IteratorGetNext:0", "dtype": "float32", "shape": [4]}],
        "ids": {},
    }
    assert record["summary"].endswith(
        "; triage: data — the batch without example 3 (filled with copies of example 0) is "
        f"finite (fingerprints {fingerprint})"
    )


def _weights_of_1e30(x):
    """A term whose weights (finite) overflow every example's square."""
    v = tf.compat.v1.get_variable("v", [ta.FEATURES], initializer=tf.constant_initializer(1e30))
    return tf.reduce_mean(tf.reduce_sum(tf.square(x * v), axis=1))


@lib.each_mode
def test_weights_that_overflow_every_example_are_state(tmp_path, mode):
    model = ta._Model(mode, extra_loss=_weights_of_1e30)
    record, autopsy = _verdict_of_the_first_bad_step(tmp_path, model)
    assert autopsy.bad_examples == tuple(range(ta.BATCH))
    assert autopsy.triage["verdict"] == "state"
    assert autopsy.triage["runs"] == [{"fed": "same batch", "outcome": "Inf"}]
    assert record["summary"].endswith(
        "; triage: state — the replay is Inf and no example stands out"
    )


@lib.each_mode
def test_a_batch_whose_every_example_holds_nan_is_data_and_auto_quarantines_them(tmp_path, mode):
    """Every example of batch 2 holds a NaN itself: no example stands out, yet the data is to
    blame, not the weights (the batch held the first non-finite value). auto skips the batch
    and quarantines its six examples."""
    data = ta._batches()
    data[ta.BAD_BATCH, :, 1] = np.nan
    model = ta._Model(mode, data=data, nan_policy="auto")
    record, autopsy = _verdict_of_the_first_bad_step(tmp_path, model)
    assert autopsy.bad_examples == tuple(range(ta.BATCH))
    triage = autopsy.triage
    action = ta._bad_steps(tmp_path)[0]["action"]
    assert (triage["verdict"], triage["in_batch"], action) == ("data", True, "skip")
    prints = [quarantine.fingerprint([row]) for row in data[ta.BAD_BATCH]]
    assert [triage["fingerprints"][str(i)] for i in range(ta.BATCH)] == prints
    assert record["summary"].endswith(
        f"; triage: data — the batch itself holds NaN or Inf in all 6 examples (fingerprints "
        f"{prints[0]}, {prints[1]}, {prints[2]} and 3 more)"
    )
    assert sorted(r["fingerprint"] for r in quarantine.read(str(tmp_path))) == sorted(prints)


def test_the_worst_outcome_of_the_chunks_is_the_runs():
    assert _triage.worst(["finite", "Inf", "NaN", "finite"]) == "NaN"
    assert _triage.worst(["finite", "Inf"]) == "Inf"
    assert _triage.worst(["finite"]) == "finite" == _triage.worst([])


def test_the_spike_threshold_is_the_z_rule_solved_for_the_loss():
    """z = (log(loss) - log_mean) / deviation: a loss at the threshold has z = sigma."""
    figures = {"loss": 50.0, "log_mean_loss": math.log(0.2), "z_loss": 11.0, "sigma": 6.0}
    deviation = (math.log(50.0) - math.log(0.2)) / 11.0
    threshold = _triage.spike_threshold(figures)
    assert (math.log(threshold) - math.log(0.2)) / deviation == pytest.approx(6.0)
    assert _triage.spike_threshold({**figures, "z_loss": 4.0}) is None  # Caught on the norm.
    assert _triage.spike_threshold(None) is None


def test_a_spikes_verdict_from_its_per_example_losses():
    feeds = {"x": np.arange(8.0).reshape(4, 2)}
    losses = np.array([0.1, 40.0, 0.2, 0.3])  # Mean 10.15; without example 1: 0.2.
    data = _triage.spike_triage(losses, [1], 2.0, feeds, 4)
    assert (data["verdict"], data["examples"]) == ("data", [1])
    assert data["runs"][-1] == {"fed": "without rows", "rows": [1], "loss": pytest.approx(0.2)}
    prints = _triage.identify(feeds, [1], 4)["fingerprints"]
    assert _triage.sentence(data) == (
        f"triage: data — without example 1 the batch's loss is 0.2, within the spike threshold "
        f"2 (fingerprints {prints['1']})"
    )
    state = _triage.spike_triage(np.array([9.0, 40.0, 8.0, 7.0]), [1], 2.0, feeds, 4)
    assert state["verdict"] == "state"
    assert _triage.sentence(state) == (
        "triage: state — without example 1 the batch's loss is 8, over the spike threshold 2"
    )
    whole = _triage.spike_triage(np.array([9.0, 8.0, 8.0, 7.0]), [], 2.0, feeds, 4)
    assert _triage.sentence(whole) == (
        "triage: state — the replay's loss 8 is over the spike threshold 2; no example stood out"
    )
    every = _triage.spike_triage(np.array([9.0, 8.0, 8.0, 7.0]), [0, 1, 2, 3], 2.0, feeds, 4)
    assert _triage.sentence(every) == (
        "triage: state — the replay's loss 8 is over the spike threshold 2; every example stood out"
    )
    chance = _triage.spike_triage(np.array([0.1, 0.2, 0.1, 0.2]), [], 2.0, feeds, 4)
    assert (chance["verdict"], chance["examples"]) == ("chance", [])
    assert _triage.sentence(chance) == (
        "triage: chance — the replay's loss 0.15 is within the spike threshold 2"
    )
