"""A finite value is never called non-finite, however large.

A sum is the guard's fast test: finite elements can add up past the float range (1,000
gradients of 1e36 in float32, two weights near 3e38, four float16 values near 65504), so a
non-finite sum is confirmed element by element before anything is called NaN or Inf. Each
story runs a few steps of a small graph whose gradients the test chooses: the huge finite
steps train, the truly bad ones are caught and named with what they held, and every saver
writes huge finite weights and refuses NaN and Inf with the step it was asked to save.
"""

import os
import time
from typing import Dict, Optional

import numpy as np
import pytest
import tensorflow as tf

import slim_nanguard
from slim_nanguard import _actions
from slim_nanguard import _checkpoints
from slim_nanguard import _exact_sums

import nanguard_testlib as lib

F32_MAX = float(np.finfo(np.float32).max)  # 3.4e38
F16_MAX = float(np.finfo(np.float16).max)  # 65504

HUGE = 1000  # elements of the variable whose gradients are huge


def _scaled(x: tf.Tensor, gradient: tf.Tensor) -> tf.Tensor:
    """`x` forward; `gradient` times the upstream gradient backward, so the loss stays finite
    whatever the gradient is (NaN and Inf included)."""

    @tf.custom_gradient
    def scaled(value):
        return tf.identity(value), lambda dy: dy * tf.cast(gradient, dy.dtype)

    return scaled(x)


class _Model:
    """Two variables, ``huge`` (1,000 elements) and ``w`` (3), both zeros; the loss is the sum of
    their values (0.0 at first) plus ``loss_offset``, and the gradient of each element is what
    ``huge_gradient`` and ``w_gradient`` say (defaults 1e36 and 1.0). SGD at 1e-36 moves each
    element of ``huge`` by -1 on a default step. A float16 model takes a float16 gradient."""

    def __init__(self, mode: str, dtype=tf.float32, lr: float = 1e-36, huge_gradient: float = 1e36):
        self.graph = tf.Graph()
        with self.graph.as_default():
            self.huge_gradient = tf.compat.v1.placeholder_with_default(
                tf.constant(huge_gradient, dtype), [], name="huge_gradient"
            )
            self.w_gradient = tf.compat.v1.placeholder_with_default(
                tf.constant(1.0, dtype), [], name="w_gradient"
            )
            self.loss_offset = tf.compat.v1.placeholder_with_default(0.0, [], name="loss_offset")
            zeros = tf.compat.v1.zeros_initializer()
            self.huge = tf.compat.v1.get_variable("huge", [HUGE], dtype, zeros, use_resource=True)
            self.w = tf.compat.v1.get_variable("w", [3], dtype, zeros, use_resource=True)
            total = tf.reduce_sum(_scaled(self.huge, self.huge_gradient)) + tf.reduce_sum(
                _scaled(self.w, self.w_gradient)
            )
            loss = tf.cast(total, tf.float32) + self.loss_offset
            self.train_op = slim_nanguard.create_train_op(
                loss,
                tf.compat.v1.train.GradientDescentOptimizer(lr),
                check_numerics=lib.MODES[mode],
                nan_policy="skip",
            )
        self.guard = slim_nanguard.get_guard(self.train_op)
        self.mode = mode

    def run(self, feeds):
        """Runs one step per feed in a MonitoredTrainingSession, as the README's loop does."""
        hooks = [slim_nanguard.nan_hook(self.train_op)] if self.mode == "hook" else []
        return lib.run_monitored(
            self.train_op,
            hooks=hooks,
            feeds=[{getattr(self, k): v for k, v in feed.items()} for feed in feeds],
            handle_numerics_errors=True,
        )


def _good(run: lib.MonitoredRun, model: _Model, steps: int) -> None:
    """Every step trained: the global step moved on and no bad step was counted."""
    assert run.events == [] and run.bad_step_changes == []
    assert model.guard.state.total_bad_steps == 0
    assert int(run.final["global_step"]) == steps


@lib.each_mode
def test_a_thousand_gradients_of_1e36_make_a_good_step(mode):
    """The gradient of ``huge`` is 1e36 in each of its 1,000 elements (finite, loss 0.0): its
    float32 sum overflows, but the step trains, as does the next one."""
    model = _Model(mode)
    assert _fast_test_passes(model) is False  # the cheap sum overflows: the exact test decides
    run = model.run([{}, {}])
    _good(run, model, 2)
    np.testing.assert_allclose(run.final["huge"], -2.0, rtol=1e-5)


def _fast_test_passes(model: _Model, **feed) -> bool:
    """What the guard's cheap test (the loss plus half the gradients' float32 sum of squares)
    says of a step of `model` fed `feed`, read without training."""
    graph = model.train_op.graph
    fast = graph.get_tensor_by_name("nanguard/verdict/fast_all_finite:0")
    with tf.compat.v1.Session(graph=graph) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        return bool(sess.run(fast, {getattr(model, k): v for k, v in feed.items()}))


@lib.each_mode
def test_gradients_near_float32_max_make_a_good_step(mode):
    """Every element of the gradient is 3e38, just under float32's largest value."""
    model = _Model(mode)
    assert _fast_test_passes(model, huge_gradient=3e38) is False
    run = model.run([{"huge_gradient": 3e38}])
    _good(run, model, 1)
    np.testing.assert_allclose(run.final["huge"], -300.0, rtol=1e-5)


@lib.each_mode
def test_a_loss_near_float32_max_with_a_huge_gradient_makes_a_good_step(mode):
    """The loss is 3e38 and a gradient sums to 3e38: each is finite, their sum is not."""
    model = _Model(mode)
    run = model.run([{"loss_offset": 3e38, "w_gradient": F32_MAX / 3}])
    _good(run, model, 1)


@lib.each_mode
def test_float16_gradients_near_the_float16_limit_make_a_good_step(mode):
    """Mixed precision: float16 weights whose gradients are 60,000 each (float16's largest
    value is 65,504); a float16 sum of two of them would already be Inf."""
    model = _Model(mode, dtype=tf.float16, lr=1e-4, huge_gradient=60000.0)
    run = model.run([{"w_gradient": F16_MAX}])
    _good(run, model, 1)
    np.testing.assert_allclose(run.final["huge"].astype(np.float32), -6.0, rtol=1e-2)


def _bad_step(model: _Model, feed: Dict, loss_offset: Optional[float] = None):
    """One good step, then one bad one (skipped): its event, and the variables it changed."""
    run = model.run([{}, feed])
    assert len(run.events) == 1 and run.bad_step_changes == [[]]
    assert int(run.final["global_step"]) == 1
    return run.events[0]


# (what the batch does, the feed, the culprits and what each held)
TRULY_BAD = [
    ("nan_gradient", {"w_gradient": np.nan}, ("w",), ("nan",)),
    ("inf_gradient", {"w_gradient": np.inf}, ("w",), ("inf",)),
    # The overflowing sum of ``huge`` next to a NaN in w: only w is a culprit.
    ("nan_beside_a_huge_sum", {"w_gradient": np.nan, "huge_gradient": 3e38}, ("w",), ("nan",)),
    ("inf_and_nan", {"w_gradient": np.nan, "huge_gradient": np.inf}, ("huge", "w"), ("inf", "nan")),
]


@pytest.mark.parametrize(
    "feed,culprits,kinds", [t[1:] for t in TRULY_BAD], ids=[t[0] for t in TRULY_BAD]
)
@lib.each_mode
def test_a_true_nan_or_inf_is_caught_and_named_for_what_it_held(mode, feed, culprits, kinds):
    """The loss stays finite (the gradients alone go bad); the step writes nothing, and the
    event, its line and its record name each culprit with NaN or Inf."""
    model = _Model(mode)
    records = []
    model.guard.add_listener(records.append)
    event = _bad_step(model, feed)
    assert event.loss_kind == "finite"
    assert event.culprits == culprits and event.culprit_kinds == kinds
    words = {"nan": "NaN", "inf": "Inf"}
    if len(set(kinds)) == 1:
        assert f"non-finite gradients of {', '.join(culprits)}, holding {words[kinds[0]]}," in (
            event.describe()
        )
    else:
        for name, kind in zip(culprits, kinds):
            assert f"{words[kind]} in {name}" in event.describe()
    assert records[0]["culprits"] == list(culprits)
    assert records[0]["culprit_kinds"] == list(kinds)


@lib.each_mode
def test_a_true_inf_in_a_float16_gradient_is_named_inf(mode):
    model = _Model(mode, dtype=tf.float16, lr=1e-4, huge_gradient=60000.0)
    event = _bad_step(model, {"huge_gradient": np.inf})
    assert event.culprits == ("huge",) and event.culprit_kinds == ("inf",)


@lib.each_mode
def test_an_inf_loss_with_finite_gradients_names_no_culprit(mode):
    event = _bad_step(_Model(mode), {"loss_offset": np.inf})
    assert event.loss_kind == "inf" and event.culprits == () and event.culprit_kinds == ()


def test_a_good_step_runs_no_element_wise_test():
    """The exact test sits on the branch a failed sum takes: a good step runs none of it."""
    for mode in lib.MODES:
        model = _Model(mode)
        with model.graph.as_default(), tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            _actions.mark_judged(model.guard, sess)
            metadata = tf.compat.v1.RunMetadata()
            sess.run(
                model.train_op,
                {model.huge_gradient: 1.0},
                options=tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
                run_metadata=metadata,
            )
            ran = {n.node_name for d in metadata.step_stats.dev_stats for n in d.node_stats}
        ran_types = {model.graph.get_operation_by_name(n).type for n in ran if _in_graph(model, n)}
        assert not ran_types & {"IsNan", "IsInf", "Any", "All"}, (mode, ran_types)


def _in_graph(model: _Model, name: str) -> bool:
    try:
        model.graph.get_operation_by_name(name)
    except KeyError:
        return False
    return True


# ------------------------------------------------------------------ savers


def _weights_graph():
    """A float32 variable of 1,000 weights of 5e36 (LeNet's after one step at a learning
    rate of 1e36), a float16 one near its limit, and a global step of 7."""
    graph = tf.Graph()
    with graph.as_default():
        big = tf.compat.v1.get_variable("big", initializer=tf.fill([HUGE], 5e36), use_resource=True)
        half = tf.compat.v1.get_variable(
            "half", initializer=tf.fill([4], tf.constant(F16_MAX, tf.float16)), use_resource=True
        )
        step = tf.compat.v1.train.get_or_create_global_step()
        init = tf.compat.v1.global_variables_initializer()
        # The assign waits for the initializer: in one run without the edge, either may win.
        with tf.control_dependencies([init]):
            setup = step.assign(7)
        poison = tf.group(
            big.assign(tf.tensor_scatter_nd_update(big, [[0]], [np.nan])),
            half.assign(
                tf.tensor_scatter_nd_update(half, [[1]], tf.constant([np.inf], tf.float16))
            ),
        )
    return graph, setup, poison, step


# FiniteSaver, and a user's own Saver behind the same check (as `train` wraps the saver of a
# Scaffold).
SAVERS = {
    "FiniteSaver": lambda: slim_nanguard.FiniteSaver(),
    "users_saver": lambda: _checkpoints.finite_saver(tf.compat.v1.train.Saver()),
}


@pytest.mark.parametrize("make_saver", SAVERS.values(), ids=SAVERS.keys())
@pytest.mark.parametrize("step_as", ["tensor", "int"])
def test_every_saver_writes_huge_finite_weights_and_refuses_nan_and_inf(
    make_saver, step_as, tmp_path, caplog
):
    graph, setup, poison, step = _weights_graph()
    with graph.as_default():
        saver = make_saver()
        with tf.compat.v1.Session() as sess:
            sess.run(setup)
            global_step = step if step_as == "tensor" else 7
            path = saver.save(sess, os.path.join(str(tmp_path), "model.ckpt"), global_step)
            assert path and path.endswith("model.ckpt-7")
            values = lib.checkpoint_values(path)
            np.testing.assert_allclose(values["big"], 5e36, rtol=1e-6)
            assert np.all(values["half"] == np.float16(F16_MAX))
            assert slim_nanguard.non_finite_variables(path) == ()
            assert saver.refused_saves == 0
            sess.run(poison)
            with caplog.at_level("ERROR"):
                refused = saver.save(sess, os.path.join(str(tmp_path), "model.ckpt"), global_step)
    assert refused is None and saver.refused_saves == 1
    message = "\n".join(r.getMessage() for r in caplog.records if "not saving" in r.getMessage())
    assert "(step 7)" in message, message
    assert "NaN in big" in message and "Inf in half" in message, message
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith("model.ckpt-7")


def test_stop_closes_with_a_checkpoint_of_huge_last_good_weights(tmp_path):
    """The issue's LeNet run: the weights reach 5e36 (finite), then a step goes bad; `stop`
    closes with a checkpoint of those weights, which train() loaded and saved unrefused."""
    graph = tf.Graph()
    with graph.as_default():
        big = tf.compat.v1.get_variable("big", initializer=tf.fill([HUGE], 5e36), use_resource=True)
        w = tf.compat.v1.get_variable("w", initializer=tf.zeros([3]), use_resource=True)
        step = tf.compat.v1.train.get_or_create_global_step()
        # Step 1's gradient of w is NaN; the loss (the sum of w) stays finite.
        gradient = tf.where(tf.equal(step, 1), np.nan, 1.0)
        loss = tf.reduce_sum(_scaled(w, gradient)) + 0.0 * tf.reduce_sum(big[:1])
        train_op = slim_nanguard.create_train_op(
            loss, tf.compat.v1.train.GradientDescentOptimizer(0.1), nan_policy="stop"
        )
    result = slim_nanguard.train(
        train_op, str(tmp_path), number_of_steps=5, save_summaries_steps=None, log_every_n_steps=0
    )
    assert result.bad_steps == 1 and result.steps == 1
    checkpoint = tf.train.latest_checkpoint(str(tmp_path))
    assert checkpoint.endswith("-1"), checkpoint
    values = lib.checkpoint_values(checkpoint)
    np.testing.assert_allclose(values["big"], 5e36, rtol=1e-6)
    assert slim_nanguard.non_finite_variables(checkpoint) == ()


# ------------------------------------------------------------------ a sync-replicas chief


def test_a_chief_applies_an_aggregated_gradient_of_1e36_in_each_of_1000_elements():
    """Two replicas' gradients of 1e36 (each element, 1,000 of them) average to 1e36: finite,
    though its float32 sum is not. The chief's check of the aggregate lets it through."""
    graph = tf.Graph()
    with graph.as_default():
        huge = tf.compat.v1.get_variable("huge", initializer=tf.zeros([HUGE]), use_resource=True)
        optimizer = tf.compat.v1.train.SyncReplicasOptimizer(
            tf.compat.v1.train.GradientDescentOptimizer(1e-36),
            replicas_to_aggregate=2,
            total_num_replicas=2,
        )
        loss = tf.reduce_sum(_scaled(huge, tf.constant(1e36)))
        train_op = slim_nanguard.create_train_op(loss, optimizer, nan_policy="skip")
        global_step = tf.compat.v1.train.get_global_step()
        session = tf.compat.v1.train.MonitoredTrainingSession(
            is_chief=True,
            hooks=[optimizer.make_session_run_hook(is_chief=True)],
            save_checkpoint_secs=None,
            save_summaries_steps=None,
            save_summaries_secs=None,
            log_step_count_steps=None,
            stop_grace_period_secs=1,
        )
        with session as sess:
            sess.run(train_op)
            sess.run(train_op)  # the second replica's gradient completes the round
            raw = sess._tf_sess()  # pylint: disable=protected-access
            for _ in range(50):  # the chief's queue runner applies the round
                if raw.run(global_step) == 1:
                    break
                time.sleep(0.1)
            assert raw.run(global_step) == 1
            np.testing.assert_allclose(raw.run(huge), -1.0, rtol=1e-5)


# ------------------------------------------------------------------ one reduction pass


def _verdict_of(arrays, loss=0.0, sparse=()):
    """A `Verdict` over constant gradients (`tf.IndexedSlices` for the indices in `sparse`),
    and its values: ``fast``, ``ok``, the kinds and the global norm."""
    graph = tf.Graph()
    with graph.as_default():
        grads = []
        for i, a in enumerate(arrays):
            value = tf.constant(a)
            if i in sparse:
                value = tf.IndexedSlices(value, tf.range(a.shape[0]), tf.constant([50, 2]))
            grads.append(value)
        verdict = _exact_sums.Verdict(grads, loss=tf.constant(loss, tf.float32))
        with tf.compat.v1.Session() as sess:
            fast, ok, norm = sess.run([verdict.fast, verdict.ok, verdict.global_norm])
            kinds = sess.run(verdict.kinds) if not fast else None
    return fast, ok, kinds, norm


def _numpy_norm(arrays) -> float:
    return float(np.sqrt(sum(np.sum(np.square(a.astype(np.float64))) for a in arrays)))


def _gradients(rng, dtype=np.float32):
    """Seven gradients: four of one shape (stacked together), two more of another, a vector."""
    return [rng.standard_normal(s).astype(dtype) for s in [(8, 8)] * 4 + [(3,)] * 2 + [(5,)]]


def test_a_good_steps_norm_is_the_global_norm():
    arrays = _gradients(np.random.default_rng(0))
    fast, ok, kinds, norm = _verdict_of(arrays, loss=2.5)
    assert fast and ok and kinds is None
    np.testing.assert_allclose(norm, _numpy_norm(arrays), rtol=1e-6)
    # The same as TensorFlow's own, which reduces each gradient alone.
    with tf.Graph().as_default(), tf.compat.v1.Session() as sess:
        expected = sess.run(tf.linalg.global_norm([tf.constant(a) for a in arrays]))
    np.testing.assert_allclose(norm, expected, rtol=1e-6)


def test_sparse_and_float16_gradients_count_in_the_norm():
    rng = np.random.default_rng(1)
    arrays = [
        rng.standard_normal((4, 2)).astype(np.float32),  # IndexedSlices values
        np.full((4, 2), F16_MAX, np.float16),  # a float16 sum of two would be Inf
        np.full((4, 2), -F16_MAX, np.float16),
    ]
    fast, ok, _, norm = _verdict_of(arrays, sparse=(0,))
    assert fast and ok
    np.testing.assert_allclose(norm, _numpy_norm(arrays), rtol=1e-6)


def test_an_overflowing_sum_of_finite_squares_has_a_finite_float64_norm():
    """1,000 elements of 1e36: their float32 squares overflow, so the fast test fails; the
    values are finite, and the norm is summed again in float64 on that branch."""
    arrays = [np.full([HUGE], 1e36, np.float32), np.ones([3], np.float32)]
    fast, ok, kinds, norm = _verdict_of(arrays)
    assert not fast and ok and list(kinds) == [0, 0, 0]
    np.testing.assert_allclose(norm, _numpy_norm(arrays), rtol=1e-6)
    assert np.isfinite(norm) and norm > F32_MAX / 1e2


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_a_bad_value_in_a_stacked_group_names_its_own_tensor_only(dtype, bad):
    arrays = _gradients(np.random.default_rng(2), dtype)
    arrays[2][3, 4] = bad  # the third of the four stacked (8, 8) gradients
    fast, ok, kinds, norm = _verdict_of(arrays)
    code = 1 if np.isnan(bad) else 2
    assert not fast and not ok
    assert list(kinds) == [0, 0, 0, code, 0, 0, 0, 0]  # the loss first
    assert np.isnan(norm) if code == 1 else norm == np.inf


@pytest.mark.parametrize(
    "value,dtype",
    [(F32_MAX, np.float32), (np.sqrt(F32_MAX) * 2, np.float32), (F16_MAX, np.float16)],
    ids=["float32_max", "square_past_float32_max", "float16_max"],
)
def test_values_near_the_float_limits_are_finite(value, dtype):
    arrays = _gradients(np.random.default_rng(3), dtype)
    arrays[1][0, 0] = value
    arrays[5][0] = -value
    fast, ok, kinds, norm = _verdict_of(arrays)
    assert ok and (fast or list(kinds) == [0] * 8)
    np.testing.assert_allclose(norm, _numpy_norm(arrays), rtol=1e-6)


def test_a_good_step_runs_fewer_reductions_than_there_are_gradients():
    """Gradients of one shape are reduced together: 30 of them, a handful of reductions."""
    graph = tf.Graph()
    with graph.as_default():
        variables = [
            tf.compat.v1.get_variable(f"v{i}", [16, 16], use_resource=True) for i in range(30)
        ]
        loss = tf.add_n([tf.reduce_sum(tf.square(v)) for v in variables])
        train_op = slim_nanguard.create_train_op(
            loss, tf.compat.v1.train.GradientDescentOptimizer(0.1)
        )
        with tf.compat.v1.Session() as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            metadata = tf.compat.v1.RunMetadata()
            sess.run(
                train_op,
                options=tf.compat.v1.RunOptions(trace_level=tf.compat.v1.RunOptions.FULL_TRACE),
                run_metadata=metadata,
            )
    ran = [n.node_name for d in metadata.step_stats.dev_stats for n in d.node_stats]
    types = [graph.get_operation_by_name(n).type for n in ran if n.startswith("nanguard/")]
    reductions = [t for t in types if t in ("Sum", "L2Loss", "IsNan", "IsInf")]
    assert 0 < len(reductions) <= 5, types


@pytest.mark.parametrize(
    "chunk_bytes", [1 << 24, 64, 1], ids=["one_chunk", "small_chunks", "alone"]
)
def test_kinds_name_each_tensor_exactly_wherever_the_chunks_fall(monkeypatch, chunk_bytes):
    """On a failed step the tensors are laid end to end in chunks and their NaNs and Infs
    counted by running sums: a bad value at a tensor's first or last element, an empty
    tensor beside a bad one, float16, bfloat16, float32 and float64, a sparse gradient and a
    tensor of unknown size are each named for what they alone hold."""
    monkeypatch.setattr(_exact_sums, "_CHUNK_BYTES", chunk_bytes)
    monkeypatch.setattr(_exact_sums, "_CHUNK_ELEMENTS", 40)  # a 50-element tensor goes alone
    arrays = [
        np.array([np.nan, 1, 2], np.float32),  # NaN first
        np.zeros([0], np.float32),  # empty, between two bad ones
        np.array([[1, 2], [3, np.inf]], np.float32),  # Inf last
        np.array([np.inf, np.nan], np.float16),
        np.ones([5], np.float16),
        np.full([50], 3.0e38, np.float32),  # finite, over the element limit
        np.array([1.0, -np.inf], np.float32),
        np.float32(7.0),  # a scalar
        np.array([[0.5, np.nan], [1.0, 2.0]], np.float64),
        np.array([1.0, 2.0], np.float64),
        np.array([np.inf, 1.0], tf.bfloat16.as_numpy_dtype),
        np.array([3.0, 1.0], tf.bfloat16.as_numpy_dtype),
    ]
    # Then the sparse NaN and the finite tensor of unknown size.
    expected = [1, 0, 2, 3, 0, 0, 2, 0, 1, 0, 2, 0, 1, 0]
    graph = tf.Graph()
    with graph.as_default():
        tensors = [tf.constant(a) for a in arrays]
        sparse = tf.IndexedSlices(tf.constant([[0.0, np.nan]]), tf.constant([1]))
        unknown = tf.compat.v1.placeholder_with_default(np.ones([4], np.float32), [None])
        flags = _exact_sums.kind_flags(tensors + [sparse, unknown])
        with tf.compat.v1.Session() as sess:
            values = sess.run(flags)
    assert list(values[:, 0] + 2 * values[:, 1]) == expected
