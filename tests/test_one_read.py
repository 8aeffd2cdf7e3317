"""A bad step is read once: the loop learns everything the guard needs in one ``session.run``.

The story: tf-slim's `learning.train` runs `slim_nanguard.train_step` on a small MLP; a few
good steps pass, then one batch is bad (a NaN loss, or a spike with a spike policy). Between
the run of the train op that was rejected and the policy's answer, the guard runs the session
exactly once (the autopsy is off: it replays the step and reads on its own); after the answer,
one more run writes the TensorBoard counters (`nanguard/counters`, fed: no batch). A good step
runs the session once: the train op's own run.
"""

import pytest
import tensorflow as tf

import slim_nanguard

import nanguard_testlib as lib


class _CountingSession:
    """A session that counts its runs and passes everything else through."""

    def __init__(self, session):
        self._session = session
        self.runs = 0
        self.fetched = []

    def run(self, *args, **kwargs):
        self.runs += 1
        self.fetched.append(args[0] if args else kwargs.get("fetches"))
        return self._session.run(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._session, name)


@lib.each_mode
@pytest.mark.parametrize(
    "fault, options",
    [
        ("nan_loss", {}),
        (lib.SPIKE, {"spike_policy": "skip", "spike_warmup_steps": 5}),
    ],
    ids=["non_finite", "spike"],
)
def test_a_bad_step_costs_one_read_before_the_policy_answers(mode, fault, options):
    bad_batch = 12
    model = lib.build_model(
        optimizer="sgd",
        faults={bad_batch: fault},
        check_numerics=lib.MODES[mode],
        config=slim_nanguard.GuardConfig(nan_policy="skip", autopsy_max_steps=0, **options),
    )
    guard = slim_nanguard.get_guard(model.train_op)
    with model.graph.as_default(), tf.compat.v1.Session() as raw:
        raw.run(tf.compat.v1.global_variables_initializer())
        session = _CountingSession(raw)
        runs_per_step = []
        for _ in range(bad_batch + 3):
            before = session.runs
            slim_nanguard.train_step(session, model.train_op, model.global_step, {})
            runs_per_step.append(session.runs - before)

    assert guard.state.total_bad_steps == 1
    assert guard.last_event.step == bad_batch
    # The bad step: the train op's run, then one read of everything the guard needs, then (the
    # policy has answered) the write of the counters TensorBoard shows.
    assert runs_per_step[bad_batch] == 3, runs_per_step
    first = sum(runs_per_step[:bad_batch])
    assert session.fetched[first + 2] is guard.counters.initializer, session.fetched[first:]
    assert all(f is not guard.counters.initializer for f in session.fetched[: first + 2])
    # Every other good step, before and after it: the train op's run alone. The first step in
    # hook mode also marks the session as judged by this loop (once per session).
    assert runs_per_step[0] == (2 if mode == "hook" else 1), runs_per_step
    assert set(runs_per_step[1:bad_batch] + runs_per_step[bad_batch + 1 :]) == {1}, runs_per_step
