"""`train`: the guarded training loop over `tf.compat.v1.train.MonitoredTrainingSession`.

A run::

    restore the latest readable checkpoint of logdir, or initialise (scaffold's init_fn)
    refuse to go on if any variable is NaN or Inf
    while not stopped and global step < number_of_steps:
        run(train_op)            # a bad step writes no variable
        bad step? -> policy      # hook mode: NanLossHook.after_run; check_numerics mode: here
        every log_every_n_steps: a progress line; on the summaries' schedule: nanguard/loss
        Ctrl-C or SIGTERM: stop after this step
    end(): closing checkpoint (FiniteSaver), final values
    giving up: first save the (good) state the bad step left, then raise
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import signal
import threading
import time
import uuid
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import tensorflow as tf

from slim_nanguard import _actions
from slim_nanguard import _checkpoints
from slim_nanguard import _errors
from slim_nanguard import _exact_sums
from slim_nanguard import _guard
from slim_nanguard import _hook
from slim_nanguard import _log as logging
from slim_nanguard import _paths
from slim_nanguard import _policy
from slim_nanguard import _recorders
from slim_nanguard._types import Action
from slim_nanguard._types import Mode
from slim_nanguard._types import StopReason


@dataclasses.dataclass(frozen=True)
class TrainResult:
    """What a call to `train` did.

    Attributes:
      final_loss: Loss of the last good step (NaN if none went through; the summary and the
        record's stop event then say none).
      global_step: The global step at the end.
      steps, bad_steps, skips, rollbacks: This call's good steps, bad steps, skipped bad steps
        and rollbacks.
      stop_reason: Why the call ended, a `StopReason`.
      checkpoint: The latest checkpoint in the log directory after the run, or None.
      events_path: The JSON-lines record of bad steps.
      learning_rate_scale: The model's learning-rate scale at the end (rollback factors multiplied).
      loss_scale_overflows: Overflow steps of a dynamic loss-scale optimizer (not bad steps).
      rollback_requests: A non-chief worker's bad steps whose rollback it asked the chief for.
      spikes: The bad steps that were spikes (``spike_policy``).
      retries: Under ``nan_policy="auto"`` or ``spike_policy="auto"``, the bad steps
        (triage: chance) run again on their batch that then trained (not among `skips`, nor
        `steps`).
      rejected: The finite bad steps each reason rejected, by its name (``{"spike": 2}``).
      climb, resume_from: After a stop whose accepted steps climbed to the bad step (then
        `checkpoint` holds no good state): the global step the climb began at, and the newest
        checkpoint from before it (None: none is kept); else None.
    """

    final_loss: float
    global_step: int
    steps: int
    bad_steps: int
    skips: int
    rollbacks: int
    stop_reason: str
    checkpoint: Optional[str]
    events_path: str
    learning_rate_scale: float = 1.0
    loss_scale_overflows: int = 0
    rollback_requests: int = 0
    spikes: int = 0
    retries: int = 0
    rejected: Dict[str, int] = dataclasses.field(default_factory=dict)
    climb: Optional[int] = None
    resume_from: Optional[str] = None

    def describe(self) -> str:
        """A few lines for the end of a run."""
        n = self.loss_scale_overflows
        overflows = f", {n} loss-scale overflows" if n else ""
        requests = f", {self.rollback_requests} sent to the chief" if self.rollback_requests else ""
        spikes = "".join(f"{n} of them {name}s, " for name, n in self.rejected.items() if n)
        spikes += f"{self.retries} run again and trained, " if self.retries else ""
        loss = (
            f"{self.final_loss:.6g}" if math.isfinite(self.final_loss) else "none (no step trained)"
        )
        return (
            f"stopped: {self.stop_reason}; global step {self.global_step}; final loss "
            f"{loss}; {self.steps} good steps, {self.bad_steps} bad "
            f"({spikes}{self.skips} skipped, {self.rollbacks} rolled back{requests}){overflows}\n"
            f"checkpoint: {self.checkpoint}\nevent record: {self.events_path}"
        )


@dataclasses.dataclass
class _Progress:
    """Logs a progress line every `every` global steps (0: none), with the time left to
    `last_step` when given, and writes ``nanguard/loss`` to `recorder` when `loss_due` says
    (the summaries' schedule)."""

    every: int
    last_step: Optional[int]
    recorder: Optional[_recorders.EventRecorder]
    loss_due: Callable[[int], bool] = lambda step: False
    clock: Callable[[], float] = time.monotonic
    mark: Optional[Tuple[float, int]] = None  # (time, step) at the start or the previous line

    def start(self, step: int) -> None:
        self.mark = (self.clock(), step)

    def __call__(self, step: int, loss: float, counts: Callable[[], _policy.GuardState]) -> None:
        """Logs a line at every `every`-th step, with this run's ``counts()`` (called only then)."""
        if self.recorder is not None and math.isfinite(loss) and self.loss_due(step):
            self.recorder.write_scalars(step, loss, counters=False)
        if self.every <= 0 or step % self.every:
            return
        counts = counts()
        now = self.clock()
        then, before = self.mark
        rate = (step - before) / max(now - then, 1e-9) if step > before else None
        self.mark = (now, step)
        left = ""
        if rate and self.last_step:
            left = f", {_duration((self.last_step - step) / rate)} left"
        logging.info(
            "step %d%s: loss %.4f, %s%s; bad steps %d (skipped %d, rolled back %d)",
            step,
            f"/{self.last_step}" if self.last_step else "",
            loss,
            f"{rate:.1f} steps/s" if rate else "-- steps/s",
            left,
            counts.total_bad_steps,
            counts.skips,
            counts.rollbacks,
        )


def _summary_schedule(steps: Optional[int], secs: Optional[float]) -> Callable[[int], bool]:
    """Whether a global step is due a scalar on the summaries' schedule: every `steps`-th, or
    once `secs` passed (which wins, as for `train`'s `SummarySaverHook`); never when both are
    off."""
    if secs:
        timer = tf.compat.v1.train.SecondOrStepTimer(every_secs=secs)

        def due(step: int) -> bool:
            if not timer.should_trigger_for_step(step):
                return False
            timer.update_last_triggered_step(step)
            return True

        return due
    return lambda step: bool(steps) and step % steps == 0


def _duration(seconds: float) -> str:
    minutes, seconds = divmod(int(max(seconds, 0)), 60)
    if minutes < 60:
        return f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"
    return f"{minutes // 60}h{minutes % 60:02d}m"


class _SigintStop:
    """While active (main thread only), Ctrl-C or SIGTERM (a preemption) asks the loop to stop
    after the current step (`stop_reason` set); a second one raises KeyboardInterrupt."""

    def __init__(self, enabled: bool):
        self.stop_reason: Optional[StopReason] = None
        main = threading.current_thread() is threading.main_thread()
        self._signals = (signal.SIGINT, signal.SIGTERM) if enabled and main else ()

    def __enter__(self):
        self._previous = {signum: signal.signal(signum, self._handle) for signum in self._signals}
        return self

    def _handle(self, signum, frame):
        if self.stop_reason:
            raise KeyboardInterrupt
        terminated = signum == signal.SIGTERM
        self.stop_reason = StopReason.TERMINATED if terminated else StopReason.INTERRUPTED
        logging.warning(
            "slim_nanguard: %s; stopping after this step with a final "
            "checkpoint (a second signal aborts at once).",
            "terminated (SIGTERM)" if terminated else "interrupted",
        )

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def train(
    train_op: tf.Tensor,
    logdir: str,
    *,
    number_of_steps: Optional[int] = None,
    master: str = "",
    is_chief: bool = True,
    scaffold: Optional[tf.compat.v1.train.Scaffold] = None,
    hooks: Optional[Sequence[tf.compat.v1.train.SessionRunHook]] = None,
    chief_only_hooks: Optional[Sequence[tf.compat.v1.train.SessionRunHook]] = None,
    save_checkpoint_secs: Optional[float] = 600,
    save_checkpoint_steps: Optional[int] = None,
    save_summaries_steps: Optional[int] = 100,
    save_summaries_secs: Optional[float] = None,
    config: Optional[tf.compat.v1.ConfigProto] = None,
    log_every_n_steps: int = 100,
    max_checkpoints_to_keep: int = 5,
    handle_sigint: bool = True,
    stop_grace_period_secs: float = 120,
    task: Optional[int] = None,
) -> TrainResult:
    """Runs a guarded train op until a step limit, a stop, or the end of the data.

    The arguments follow `tf_slim.training.train`. Either mode works: in hook mode it adds
    the train op's `NanLossHook` unless `hooks` has one; in check_numerics mode it applies the
    policy to the guard's numerics error and lets every other error through. No checkpoint it
    writes holds NaN or Inf. A run started again in the same `logdir` resumes from the latest
    readable checkpoint and appends to the same event record.

    Args:
      train_op: A train op from `slim_nanguard.create_train_op`.
      logdir: Where checkpoints, summaries and the event record go (created if missing).
      number_of_steps: Stop once the global step reaches this (None: until stopped).
      is_chief: Whether this process initialises, restores and saves.
      scaffold: Its saver (default: a `FiniteSaver`) is made to refuse NaN or Inf; its
        ``init_fn`` runs only when there is no checkpoint to resume from.
      save_checkpoint_secs, save_checkpoint_steps, save_summaries_steps: None or 0: off.
      log_every_n_steps: Steps between progress lines (0: none).
      handle_sigint: Whether Ctrl-C and SIGTERM stop the loop cleanly (final checkpoint and
        summary; ``stop_reason`` ``interrupted`` or ``terminated``).
      task: The task id in a cluster (None: no cluster): records name it, and task N > 0
        writes its own record (see `read_events`). Only the chief writes TensorBoard scalars.

    Raises:
      ValueError: Bad arguments (an unguarded train op or its loss, a graph without a global
        step or a train op that does not increment it, a logdir that cannot be written, a
        negative step count).
      NanLossError: The policy is ``raise``, or training gave up. The chief first saves the
        last accepted weights (the bad step wrote none); the error's ``checkpoint`` names them
        (and its ``climb`` says whether the steps before were climbing: no good state then).
      NonFiniteCheckpointError: The model holds NaN or Inf when loaded.
      CheckpointNotFoundError: Checkpoints exist but none can be read, or a rollback found none.
      DiskFullError: The disk filled up; the run was ended as a stop is, as far as it fitted.
    """
    guard, logdir = _check_arguments(train_op, logdir, number_of_steps, log_every_n_steps)
    resume_from = (
        _checkpoints.latest_good_checkpoint(logdir, repair_state=True) if is_chief else None
    )
    recorder = _recorders.EventRecorder(logdir, write_summaries=is_chief, task=task)
    guard.add_listener(recorder)
    guard.registry.use_directory(logdir, replace=True)  # Autopsy dumps go next to the checkpoints.
    loss_due = _summary_schedule(save_summaries_steps, save_summaries_secs)
    progress = _Progress(log_every_n_steps, number_of_steps, recorder, loss_due)
    step = resume_from and _checkpoints.checkpoint_step(resume_from) or 0
    loop = _Loop(guard, logdir, is_chief, number_of_steps, progress, guard.state, step=step)
    try:
        with train_op.graph.as_default():
            loop.make_scaffold(scaffold, resume_from, max_checkpoints_to_keep)
            loop.add_hooks(hooks, chief_only_hooks)
            loop.add_saving_hooks(
                save_checkpoint_secs,
                save_checkpoint_steps,
                save_summaries_steps,
                save_summaries_secs,
            )
            if resume_from:
                logging.info("slim_nanguard: resuming from %s", resume_from)
            loop.run(master, config, stop_grace_period_secs, handle_sigint)
            return loop.finish(recorder)
    except _errors.NanLossError as err:
        _record_stop(recorder, StopReason.NAN_ERROR, message=str(err), checkpoint=err.checkpoint)
        raise
    except (OSError, tf.errors.OpError) as err:
        if not _errors.is_disk_full(err):
            raise
        raise loop.end_on_full_disk(recorder, err) from err
    finally:
        guard.remove_listener(recorder)


def _check_arguments(
    train_op: tf.Tensor, logdir: str, number_of_steps: Optional[int], log_every_n_steps: int
) -> Tuple[_guard.Guard, str]:
    """The guard of `train_op` and the absolute `logdir` (created if missing; a URL as it is)."""
    guard = _guard.guard_of_train_op(train_op)
    if guard is None:
        raise ValueError(
            f"train_op {getattr(train_op, 'name', train_op)!r} was not made by "
            "slim_nanguard.create_train_op."
        )
    if tf.compat.v1.train.get_global_step(train_op.graph) is None:
        raise ValueError(
            "train needs a global step (its checkpoint, summary and step hooks count it), and "
            "this graph has none: make the train op with create_train_op's default global_step."
        )
    if guard.global_step is None:
        raise ValueError(
            "train counts its steps on the global step, and this train op does not increment "
            "it (made with global_step=None): number_of_steps would never be reached. Make it "
            "with create_train_op's default global_step."
        )
    steps_ok = isinstance(number_of_steps, int) and not isinstance(number_of_steps, bool)
    if number_of_steps is not None and (not steps_ok or number_of_steps < 0):
        raise ValueError(
            f"number_of_steps must be a non-negative integer or None; got {number_of_steps!r}."
        )
    if not isinstance(log_every_n_steps, int) or log_every_n_steps < 0:
        raise ValueError(f"log_every_n_steps must be >= 0; got {log_every_n_steps!r}.")
    if not logdir or not isinstance(logdir, (str, os.PathLike)):
        raise ValueError(f"logdir must name a directory; got {logdir!r}.")
    logdir = _paths.absolute(logdir)
    if tf.io.gfile.exists(logdir) and not tf.io.gfile.isdir(logdir):
        raise ValueError(f"logdir {logdir} is a file, not a directory.")
    probe = _paths.join(logdir, f".nanguard_write_test.{os.getpid()}.{uuid.uuid4().hex}")
    try:
        tf.io.gfile.makedirs(logdir)
        with tf.io.gfile.GFile(probe, "w") as f:
            f.write("")
        tf.io.gfile.remove(probe)
    except (OSError, tf.errors.OpError) as err:
        reason = getattr(err, "message", None) or err.strerror
        raise ValueError(
            f"logdir {logdir} cannot be written to ({reason}); choose a directory you can write to."
        ) from None
    return guard, logdir


def _record_stop(recorder: _recorders.EventRecorder, reason: str, **fields: Any) -> None:
    """Appends the record of how the run ended (kind ``stop``)."""
    recorder.append({"kind": "stop", "reason": str(reason), "time": time.time(), **fields})


@dataclasses.dataclass
class _Loop:
    """One call of `train`: its hooks, where it began (`start`) and where it is."""

    guard: _guard.Guard
    logdir: str
    is_chief: bool
    number_of_steps: Optional[int]
    progress: _Progress
    start: _policy.GuardState
    scaffold: Optional[tf.compat.v1.train.Scaffold] = None
    hooks: List[tf.compat.v1.train.SessionRunHook] = dataclasses.field(default_factory=list)
    chief_hooks: List[tf.compat.v1.train.SessionRunHook] = dataclasses.field(default_factory=list)
    judge_hook: Optional[_hook.NanLossHook] = None
    final_hook: Optional[tf.compat.v1.train.FinalOpsHook] = None
    step: int = 0
    final_loss: float = math.nan
    stop_reason: Optional[StopReason] = None
    climb: Tuple[Optional[int], Optional[str]] = (None, None)  # A stop's `Outcome.climb`.
    result: Optional[TrainResult] = None  # `finish`'s, set before the stop record is written

    def counts(self) -> _policy.GuardState:
        """What this call has seen so far: the guard's state since `start`."""
        return self.guard.state.since(self.start)

    def _at_limit(self, step: int) -> bool:
        return self.number_of_steps is not None and step >= self.number_of_steps

    def make_scaffold(self, given, resume_from: Optional[str], max_to_keep: int) -> None:
        """Sets `scaffold`: `given` with a saver that never writes NaN or Inf and, on the chief,
        an init_fn that runs for every session created (a recovered one too), restores
        `logdir`'s newest good checkpoint as it is then, or runs `given`'s init_fn if none, and
        refuses (`NonFiniteCheckpointError`) a model that then holds NaN or Inf."""
        given = given if given is not None else tf.compat.v1.train.Scaffold()
        if given.saver is None:
            # Relative paths in the 'checkpoint' file: the directory can be moved or copied.
            saver = _checkpoints.FiniteSaver(
                max_to_keep=max_to_keep, sharded=True, allow_empty=True, save_relative_paths=True
            )
        else:  # The user's saver, as given, but it never writes NaN or Inf either.
            saver = _checkpoints.finite_saver(given.saver)
        init_fn = None
        if self.is_chief:
            restorer = saver
            missing = self.guard.handles.missing_from(resume_from) if resume_from else None
            if missing:  # The guard's options turned on since: they keep their initial values.
                _checkpoints.say_restored_without(resume_from, [v.op.name for v in missing])
                kept = [v for v in tf.compat.v1.global_variables() if v not in missing]
                restorer = tf.compat.v1.train.Saver(kept, sharded=True)

            test = _checkpoints.finiteness_test(tf.compat.v1.global_variables())

            def init_fn(unused_scaffold, session: tf.compat.v1.Session) -> None:
                latest = _checkpoints.latest_good_checkpoint(self.logdir, repair_state=True)
                if latest is not None:
                    (restorer if latest == resume_from else saver).restore(session, latest)
                elif given.init_fn is not None:
                    given.init_fn(session)
                try:
                    bad = test.non_finite(session)
                except tf.errors.FailedPreconditionError:
                    return  # A variable left uninitialised: TensorFlow's ready check says so.
                if bad:
                    raise _errors.NonFiniteCheckpointError(
                        f"the model loaded from {latest or 'initialisation'} holds NaN or Inf in "
                        f"{_exact_sums.listed([name for name, _ in bad])} "
                        f"({_exact_sums.describe(bad)}); refusing to train from it. Start from "
                        "another checkpoint."
                    )

        self.scaffold = tf.compat.v1.train.Scaffold(
            saver=saver, init_fn=init_fn, copy_from_scaffold=given
        )

    def add_hooks(self, hooks, chief_only_hooks) -> None:
        """The caller's hooks, the judging hook, the step limit and the final values."""
        guard = self.guard
        self.hooks = list(hooks or [])
        # The caller's hook of this guard, else a new one, judges the runs (hook mode; and a
        # dynamic loss-scale optimizer, whose overflow steps do not raise).
        if guard.mode == Mode.HOOK or guard.ok is not None:
            theirs = (h for h in self.hooks if isinstance(h, _hook.NanLossHook))
            self.judge_hook = next((h for h in theirs if _guard.get_guard(h.loss) is guard), None)
            if self.judge_hook is None:
                self.judge_hook = _hook.NanLossHook(guard.train_op, checkpoint_dir=self.logdir)
                self.hooks.append(self.judge_hook)
        if self.number_of_steps is not None:
            self.hooks.append(tf.compat.v1.train.StopAtStepHook(last_step=self.number_of_steps))
        final_values = {"global_step": guard.global_step}
        if guard.lr_scale is not None:
            final_values["learning_rate_scale"] = guard.lr_scale
        self.final_hook = tf.compat.v1.train.FinalOpsHook(final_values)
        self.hooks.append(self.final_hook)
        self.chief_hooks = list(chief_only_hooks or [])

    def add_saving_hooks(self, checkpoint_secs, checkpoint_steps, summary_steps, summary_secs):
        """The chief's step counter, checkpoint and summary hooks."""
        self.chief_hooks.append(
            tf.compat.v1.train.StepCounterHook(output_dir=self.logdir, every_n_steps=100)
        )
        if checkpoint_secs or checkpoint_steps:
            self.chief_hooks.append(
                tf.compat.v1.train.CheckpointSaverHook(
                    self.logdir,
                    save_secs=None if checkpoint_steps else checkpoint_secs,
                    save_steps=checkpoint_steps or None,
                    scaffold=self.scaffold,
                )
            )
        if summary_steps or summary_secs:
            self.chief_hooks.append(
                tf.compat.v1.train.SummarySaverHook(
                    save_steps=None if summary_secs else summary_steps,
                    save_secs=summary_secs or None,
                    output_dir=self.logdir,
                    scaffold=self.scaffold,
                )
            )

    def run(self, master: str, config, stop_grace_period_secs: float, handle_sigint: bool) -> None:
        """Runs steps until a stop; sets `step`, `final_loss` and `stop_reason`."""
        # No checkpoint_dir: the session saves nothing itself (the chief's hooks do).
        with (
            _SigintStop(handle_sigint) as sigint,
            tf.compat.v1.train.MonitoredTrainingSession(
                master=master,
                is_chief=self.is_chief,
                scaffold=self.scaffold,
                hooks=self.hooks,
                chief_only_hooks=self.chief_hooks,
                config=config,
                stop_grace_period_secs=stop_grace_period_secs,
            ) as sess,
        ):
            self.step = self._read_step(sess)
            self.progress.start(self.step)
            # StopAtStepHook only looks after a step; it ends the loop after the start.
            finished = self._at_limit(self.step)
            if finished:
                logging.info(
                    "slim_nanguard: global step %d already reaches number_of_steps=%d; "
                    "nothing to train.",
                    self.step,
                    self.number_of_steps,
                )
            try:
                while not finished and self.stop_reason is None and not sess.should_stop():
                    self.stop_reason = self._step(sess, sigint)
            except (OSError, tf.errors.OpError):  # The step may have run, and its hooks failed.
                before = self.step
                with contextlib.suppress(Exception):
                    self.step = self._read_step(sess)
                hook = self.judge_hook  # The chief's hooks may have failed before it judged.
                if self.step > before and (hook is None or hook.last_outcome is None):
                    _actions.good_step(self.guard)  # It trained: it passed the check.
                raise
        if self.stop_reason is None:
            limit = self._at_limit(self.step)
            self.stop_reason = StopReason.STEP_LIMIT if limit else StopReason.REQUESTED

    def _step(self, sess: tf.compat.v1.train.MonitoredSession, sigint: _SigintStop):
        """Runs one step, unless a signal came; returns why the loop stops, or None."""
        if sigint.stop_reason:
            return sigint.stop_reason
        try:
            loss, outcome = self._run_train_op(sess)
        except tf.errors.OutOfRangeError:
            return StopReason.END_OF_DATA
        except _errors.NanLossError as nan_error:  # The policy gave up (either mode).
            self._save_good_state(sess, nan_error)
            raise
        if outcome.stop:
            self.climb = outcome.climb or self.climb
            return StopReason.POLICY
        if outcome.step is not None:  # A rollback, or a retry that trained.
            self.step = outcome.step
            if outcome.action != Action.ROLLBACK and self._at_limit(self.step):
                return StopReason.STEP_LIMIT  # A retry trained the last step: no hook saw it.
        if outcome.good:  # Not a bad step nor an overflow: global_step moved on.
            self.step += 1
            self.final_loss = float(np.asarray(loss))
            self.progress(self.step, self.final_loss, self.counts)
        return None

    def _read_step(self, sess: tf.compat.v1.train.MonitoredSession) -> int:
        """The global step, read around the session's hooks."""
        return _actions.raw_call(sess, lambda raw: _actions.read_global_step(self.guard, raw))

    def _run_train_op(self, sess: tf.compat.v1.train.MonitoredSession):
        """Runs the train op once: its value (None after a numerics error) and its `Outcome`."""
        try:
            loss = sess.run(self.guard.train_op)
        except tf.errors.InvalidArgumentError as err:
            if not _guard.owns_error(self.guard, err):
                raise
            # The loop stops by itself on a stop: nothing to ask the session.
            stop = _actions.no_stop
            return None, _actions.judge(
                self.guard, sess, checkpoint_dir=self.logdir, error=err, request_stop=stop
            )
        outcome = self.judge_hook.last_outcome if self.judge_hook is not None else None
        if outcome is None:  # No hook judged this run: the check let it through.
            _actions.good_step(self.guard, loss)  # (A hook that judged kept the loss itself.)
            outcome = _actions.GOOD
        return loss, outcome

    def _save_good_state(self, sess, error: _errors.NanLossError) -> None:
        """On the chief, saves the model (still at its last good step) before giving up; sets
        ``error.checkpoint`` to that save, or to the latest checkpoint if it fails."""
        path = None
        if self.is_chief:

            def save(session: tf.compat.v1.Session) -> str:
                step = _actions.read_global_step(self.guard, session)
                prefix = _paths.join(self.logdir, "model.ckpt")
                return self.scaffold.saver.save(session, prefix, global_step=step)

            try:
                path = _actions.raw_call(sess, save)
            except Exception as err:  # pylint: disable=broad-except
                # The NaN error is what the caller must see; a failed save only loses progress.
                logging.error(
                    "slim_nanguard: could not save the last accepted state before giving up: %s",
                    err,
                )
            if path:
                logging.warning(
                    "slim_nanguard: giving up; the state of the last accepted step is saved as %s",
                    path,
                )
        error.checkpoint = path or _checkpoints.latest_checkpoint(self.logdir)

    def end_on_full_disk(self, recorder, error: BaseException) -> _errors.DiskFullError:
        """Ends a run whose disk filled up as `finish` does, naming the newest checkpoint whose
        files read (the error's file may be a half-written one), with the stop record if it fits."""
        self.stop_reason, intact = StopReason.DISK_FULL, None
        with contextlib.suppress(_errors.NanGuardError):  # None readable, or NaN in it.
            intact = self.is_chief and _checkpoints.latest_good_checkpoint(self.logdir) or None
        try:
            self.finish(recorder, lambda unused_logdir: intact)
        except (OSError, tf.errors.OpError):  # No room for the stop record either.
            return _errors.DiskFullError(self.result, False, _errors.op_error_cause(error))
        return _errors.DiskFullError(self.result, True, _errors.op_error_cause(error))

    def finish(self, recorder, latest=_checkpoints.latest_checkpoint) -> TrainResult:
        """The call's `TrainResult` (naming ``latest(logdir)``), once it is logged and its stop
        record written."""
        counts = self.counts()
        stop_reason, last_step = self.stop_reason, self.step
        lr_scale = self.guard.state.learning_rate_scale
        final = self.final_hook.final_ops_values  # None when the session did not end cleanly.
        if final is not None:
            last_step = int(final["global_step"])
            # The scale the model holds: in a resumed run, the one its checkpoint carried on.
            lr_scale = float(final.get("learning_rate_scale", lr_scale))
        stop_fields = {}
        if stop_reason in (StopReason.REQUESTED, StopReason.END_OF_DATA):
            if self._at_limit(last_step):
                # The global step reached the limit; other workers (a cluster) made part of it.
                stop_reason = StopReason.STEP_LIMIT
            elif told := [h for h in self.hooks if getattr(h, "stop_reason", None)]:
                # The hook that stopped the run says why (a cluster's: another worker stopped it).
                stop_reason, stop_fields = told[0].stop_reason, dict(told[0].stop_fields)
        result = TrainResult(
            final_loss=self.final_loss,
            global_step=last_step,
            steps=counts.steps,
            bad_steps=counts.total_bad_steps,
            skips=counts.skips,
            rollbacks=counts.rollbacks,
            stop_reason=stop_reason,
            checkpoint=latest(self.logdir),
            events_path=recorder.path,
            learning_rate_scale=lr_scale,
            loss_scale_overflows=counts.loss_scale_overflows,
            rollback_requests=counts.rollback_requests,
            spikes=counts.spikes,
            retries=counts.retries,
            rejected=dict(counts.rejected),
            climb=self.climb[0],
            resume_from=self.climb[1],
        )
        loss = self.final_loss if math.isfinite(self.final_loss) else None  # JSON null: none
        logging.info("slim_nanguard: %s", result.describe().replace("\n", "; "))
        self.result = result
        _record_stop(recorder, stop_reason, step=last_step, final_loss=loss, **stop_fields)
        return result
