"""Recovery policies, the guard's counters and its one transition, `decide` (pure, no TensorFlow;
docs/guide.md, "Policies and escalation", says what each policy does)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Tuple, Union

from slim_nanguard import _reasons
from slim_nanguard._reasons import NON_FINITE
from slim_nanguard._reasons import Reason
from slim_nanguard._types import Action
from slim_nanguard._types import Cause
from slim_nanguard._types import Fault

if TYPE_CHECKING:  # pragma: no cover
    from slim_nanguard._nan_event import NanEvent

# The most accepted steps the spike statistics keep (`_spike.SpikeTest`'s window, OLMo-core's).
SPIKE_WINDOW = 128

# The spike test's `Reason` (`_spike.Spike`), known here through that interface only: `_spike`,
# which needs TensorFlow, sets it when imported (as `import slim_nanguard` does).
SPIKE_REASON: Optional[Callable[[str, float, int], Reason]] = None

POLICIES = tuple(Action)
# What a reason of yours (a `Reason`) may apply: not auto, whose triage knows NaN, Inf and
# spikes only. The spike test takes every policy (`POLICIES`).
REASON_POLICIES = tuple(a for a in Action if a is not Action.AUTO)
# What `GuardConfig.persistent_nan_policy` may be: every policy but skip and auto.
PERSISTENT_POLICIES = tuple(a for a in REASON_POLICIES if a is not Action.SKIP)
# What ``nan_policy="auto"`` does on each verdict of the triage (`_triage`); skip without one.
# A ``chance`` step is run once more before it is skipped (`Decision.retry`).
AUTO_ACTIONS = {"chance": Action.SKIP, "data": Action.SKIP, "state": Action.ROLLBACK}


# A user callback that sees each bad step before the policy acts: it returns None to keep the
# configured policy for the event (its ``action``), or the name of the policy to apply.
OnNanCallback = Callable[["NanEvent"], Optional[str]]


def _real(value: object) -> bool:
    return not isinstance(value, bool) and isinstance(value, (int, float))


def _integer(minimum: int):
    """The check of an integer setting: ``(accepts, what it must be)``."""
    return lambda v: _real(v) and isinstance(v, int) and v >= minimum, f"an integer >= {minimum}"


def _number(within, what: str):
    """The check of a setting that must be a finite number `within` accepts."""
    return lambda v: _real(v) and math.isfinite(v) and within(v), what


# Every check of `GuardConfig`, in the order made: ``(field, accepts, what it must be)``.
_CHECKS = (
    ("nan_policy", lambda p: p in POLICIES, f"one of {', '.join(POLICIES)}"),
    ("max_consecutive_bad_steps", *_integer(1)),
    (
        "persistent_nan_policy",
        lambda p: p in PERSISTENT_POLICIES,
        f"one of {', '.join(PERSISTENT_POLICIES)} (what happens once max_consecutive_bad_steps "
        "bad steps came in a row; 'skip' would never end)",
    ),
    ("rollback_skip_batches", *_integer(0)),
    ("max_rollbacks", *_integer(1)),
    (
        "rollback_lr_factor",
        *_number(lambda f: 0.0 < f <= 1.0, "a number in (0, 1] (1 keeps the learning rate)"),
    ),
    ("autopsy_max_steps", *_integer(0)),
    ("autopsy_timeout_secs", *_number(lambda t: t > 0, "a number of seconds > 0")),
    ("autopsy_keep_first", *_integer(0)),
    ("autopsy_keep_last", *_integer(1)),
    ("losses_before", *_integer(0)),
    (
        "spike_policy",
        lambda p: p is None or p in POLICIES,
        f"one of {', '.join(POLICIES)} or None (no spike test)",
    ),
    ("spike_sigma", *_number(lambda s: s > 0, "a number of deviations > 0 (6 is usual)")),
    ("spike_warmup_steps", *_integer(2)),
    (
        "spike_warmup_steps",
        lambda n: n <= SPIKE_WINDOW,
        f"at most {SPIKE_WINDOW} (the steps the spike statistics cover)",
    ),
    ("spike_level_shift_steps", *_integer(0)),
    ("on_nan", lambda f: f is None or callable(f), "callable (event -> policy name or None)"),
)


@dataclasses.dataclass(frozen=True)
class GuardConfig:
    """How a guarded train op reacts to a bad step; every setting is checked on construction.

    Attributes:
      nan_policy: The policy for non-finite steps: ``raise``, ``stop``, ``skip``, ``rollback``
        or ``auto``: each bad step is autopsied and its triage's verdict (`AUTO_ACTIONS`)
        runs it again on its batch (``chance``; skipped if bad again), skips it and quarantines
        the examples (``data``), rolls back (``state``), or skips it (no verdict).
      max_consecutive_bad_steps: Bad steps in a row under ``skip`` or ``rollback`` that escalate
        to ``persistent_nan_policy`` (not ``skip``; a rollback starts the count over).
      on_nan: Optional `OnNanCallback`, called with every bad step.
      rollback_skip_batches, rollback_lr_factor, max_rollbacks: Batches a rollback throws away
        besides the bad one, its factor on the learning rate (in (0, 1]), and how many may run.
      autopsy_max_steps, autopsy_keep_first, autopsy_keep_last: The first bad steps of this
        process that get an autopsy (0: none, and no batch is kept); the oldest and the newest
        (at least 1) dumps a directory keeps.
      losses_before: Losses of the good steps before a bad step that its record keeps.
      spike_policy: The policy for a spike (finite, but the loss or global gradient norm more
        than ``spike_sigma`` deviations above the last `SPIKE_WINDOW` accepted steps', after
        ``spike_warmup_steps``), or None: no spike test. Under ``skip``, a run of
        ``spike_level_shift_steps`` spikes that hold together is a new level (0: never).
        Under ``auto``, the spike's triage chooses, as for ``nan_policy``.
      reasons: More `Reason`s to reject a step, judged after the spike test.

    Raises:
      ValueError: A setting is out of range; the message begins with its name.
    """

    nan_policy: str = Action.RAISE
    max_consecutive_bad_steps: int = 10
    persistent_nan_policy: str = Action.RAISE
    on_nan: Optional[OnNanCallback] = None
    rollback_skip_batches: int = 1
    rollback_lr_factor: float = 1.0
    max_rollbacks: int = 3
    autopsy_max_steps: int = 3
    autopsy_timeout_secs: float = 60.0
    autopsy_keep_first: int = 3
    autopsy_keep_last: int = 3
    losses_before: int = 50
    spike_policy: Optional[str] = None
    spike_sigma: float = 6.0
    spike_warmup_steps: int = 20
    spike_level_shift_steps: int = 8
    reasons: Tuple[Reason, ...] = ()

    def __post_init__(self):
        for name, accepts, what in _CHECKS:
            if not accepts(getattr(self, name)):
                raise ValueError(f"{name} must be {what}; got {getattr(self, name)!r}.")
        for name in ("nan_policy", "spike_policy"):
            if getattr(self, name) == Action.AUTO and self.autopsy_max_steps == 0:
                raise ValueError(
                    f"{name}='auto' decides from each bad step's autopsy, and autopsy_max_steps=0"
                    " turns them off: pass autopsy_max_steps >= 1 or another policy."
                )
        object.__setattr__(self, "reasons", tuple(self.reasons))
        _reasons.check(self.reasons, REASON_POLICIES)

    @property
    def all_reasons(self) -> Tuple[Reason, ...]:
        """The reasons judged on a finite step, in order: the spike test if any, then `reasons`."""
        if self.spike_policy is None:
            return self.reasons
        spike = SPIKE_REASON(self.spike_policy, self.spike_sigma, self.spike_warmup_steps)
        return (spike,) + self.reasons


def rolls_back(config: GuardConfig, policy: Optional[str] = None) -> bool:
    """Whether a bad step can roll back with no callback choosing it (then a loop needs the
    checkpoint directory); `policy` replaces ``config.nan_policy`` (a hook's override)."""
    return bool(_what_rolls_back(config, policy))


def _what_rolls_back(config: GuardConfig, policy: Optional[str]) -> Tuple[str, ...]:
    """The settings that make a bad step roll back with no callback choosing it, named."""
    policies = [("nan_policy", config.nan_policy if policy is None else policy)]
    policies += [(reason.policy_name, reason.policy) for reason in config.all_reasons]
    escalated = " with persistent_nan_policy='rollback'"
    return tuple(
        f"{name}={str(value)!r}{'' if value in (Action.ROLLBACK, Action.AUTO) else escalated}"
        for name, value in policies
        if value in (Action.ROLLBACK, Action.AUTO)
        or (value == Action.SKIP and config.persistent_nan_policy == Action.ROLLBACK)
    )


def checkpoint_dir_message(config: GuardConfig, advice: str, policy: Optional[str] = None) -> str:
    """The error of a loop that would roll back (`rolls_back`) but knows no checkpoint
    directory. `advice` says what to pass, e.g. ``"nan_hook(train_op, checkpoint_dir=...)"``."""
    named = _what_rolls_back(config, policy)
    verb = "rolls back" if len(named) == 1 else "roll back"
    return (
        f"{' and '.join(named)} {verb}, so the loop needs the directory the session saves "
        f"checkpoints to: {advice}."
    )


def may_roll_back(config: GuardConfig, policy: Optional[str] = None) -> bool:
    """Whether a Saver is needed: `rolls_back`, or an ``on_nan`` that may choose ``rollback``."""
    return rolls_back(config, policy) or config.on_nan is not None


@dataclasses.dataclass(frozen=True)
class GuardState:
    """The guard's counters for the life of the process (across sessions), made by `decide`.

    ``rollbacks`` are a cluster chief's own and those it answered; ``steps`` are the good steps
    the loops that see them count (`train`, `train_step`, a `NanLossHook`). A check_numerics-mode
    loop of your own that only calls `handle_numerics_error` shows the guard its bad steps alone:
    there ``steps`` stays 0 and ``consecutive_bad_steps`` is the run's length as of the last bad
    step (``last_bad_step``; the next bad step starts a new run when the global step moved); run
    `train_step`, or a `nan_hook`, for counts of every step. ``rejected`` is ``(name, count)``
    of the steps each reason rejected. The run of bad steps began at global step ``run_start``
    (``reason_run``: what the reason that rejects its steps keeps of them, `Reason.decide`; the
    spike test's figures while the run is all spikes); the last new level was taken at
    ``level_taken_at`` (on probation for ``spike_warmup_steps`` steps) from spikes that began
    at ``level_start``."""

    total_bad_steps: int = 0
    consecutive_bad_steps: int = 0
    skips: int = 0
    rollbacks: int = 0
    stops: int = 0
    last_bad_step: Optional[int] = None
    learning_rate_scale: float = 1.0
    loss_scale_overflows: int = 0
    steps: int = 0
    rollback_requests: int = 0
    autopsies: int = 0
    retries: int = 0
    rejected: Tuple[Tuple[str, int], ...] = ()
    level_shifts: int = 0
    run_start: Optional[int] = None
    reason_run: Tuple[Mapping[str, Any], ...] = ()
    level_taken_at: Optional[int] = None
    level_start: Optional[int] = None

    @property
    def spikes(self) -> int:
        """The bad steps that were spikes."""
        return dict(self.rejected).get(Fault.SPIKE, 0)

    def since(self, start: "GuardState") -> "GuardState":
        """What happened since `start`: each count the difference, the rest as now."""
        before = dict(start.rejected)
        counts = [f.name for f in dataclasses.fields(self) if f.type == "int"]
        counts.remove("consecutive_bad_steps")  # The run's length: it does not only grow.
        return replace(
            self,
            rejected=tuple((name, n - before.get(name, 0)) for name, n in self.rejected),
            **{name: getattr(self, name) - getattr(start, name) for name in counts},
        )


@dataclasses.dataclass(frozen=True)
class GoodStep:
    """A step went through (the loss and every gradient finite)."""


@dataclasses.dataclass(frozen=True)
class LossScaleOverflow:
    """An overflow step of a dynamic loss-scale optimizer: no bad step, counted apart."""


@dataclasses.dataclass(frozen=True)
class BadStep:
    """A step whose loss or gradients were not finite (`cause` ``"non_finite"``), or that the
    reason `cause` names rejected, storing `figures`: what `_actions` read of it in one
    ``session.run``. `chosen` is the action the policy (or a hook's override) chose, unless
    `choose` (``on_nan``) returns another, shown the counts this step makes; under ``auto``
    the triage's `verdict` (None: none) picks the action. Not `guarded`: a
    loss no guarded train op made (its update happened, so only ``raise``, which says so, and
    ``stop`` mean anything). The rest as read: `reason` (None: non-finite), the `loss`, the
    `culprits` and what each held (`culprit_kinds`, when known), the `loss_scale`, whether it
    was a loss-scale optimizer's `overflow` (no bad step), and whether it was `autopsied`."""

    step: int
    chosen: Action
    guarded: bool = True
    cause: str = NON_FINITE
    figures: Optional[Mapping[str, Any]] = None
    reason: Any = dataclasses.field(default=None, compare=False)
    loss: float = math.nan
    culprits: Tuple[str, ...] = ()
    culprit_kinds: Tuple[str, ...] = ()
    loss_scale: Optional[float] = None
    overflow: bool = False
    autopsied: bool = False
    choose: Optional[Callable[["GuardState", "BadStep"], Optional[str]]] = dataclasses.field(
        default=None, compare=False
    )
    verdict: Optional[str] = None


@dataclasses.dataclass(frozen=True)
class RolledBack:
    """A rollback restored a checkpoint; the model trains at `learning_rate_scale` from now on."""

    learning_rate_scale: float


@dataclasses.dataclass(frozen=True)
class Retried:
    """Under ``auto``, a ``chance`` bad step was run again on its kept batch: it `trained` (the
    global step is now `step`, and a bad step there continues the run of bad steps), or it was
    bad again and is skipped."""

    step: int
    trained: bool


@dataclasses.dataclass(frozen=True)
class RollbackAsked:
    """A cluster's non-chief worker asked its chief to roll back (it restores nothing)."""


@dataclasses.dataclass(frozen=True)
class RollbackRequested:
    """A cluster's chief got rollback requests from `workers` (task ids, sorted, distinct)."""

    workers: Tuple[int, ...]


Observation = Union[
    GoodStep, LossScaleOverflow, BadStep, RolledBack, Retried, RollbackAsked, RollbackRequested
]


@dataclasses.dataclass(frozen=True)
class Decision:
    """What to do about one bad step, and why: the result of `decide`. ``escalation`` says why
    ``persistent_nan_policy`` replaced the chosen action; under ``raise``, ``reason`` says why
    training gives up (`give_up`, and the bound it names, `limit`); ``level_shift`` is the new
    level a spike completes; a rollback goes below global step ``before_step``, if set (a new
    level failed its probation). `consecutive` and `total` count the bad steps (this one
    included) in a row and in all. A skip with `retry` (``auto`` on ``chance``) first runs the
    step again on its kept batch, and skips it only if it is bad again; a skip with
    `quarantine` (``auto`` on ``data``) quarantines the examples the triage named."""

    action: Action
    escalation: str = ""
    reason: str = ""
    give_up: Optional[Cause] = None
    limit: Optional[int] = None
    level_shift: Any = None
    before_step: Optional[int] = None
    consecutive: int = 0
    total: int = 0
    retry: bool = False
    quarantine: bool = False


def wants_autopsy(config: GuardConfig, state: GuardState, policy: Optional[str] = None) -> bool:
    """Whether the next bad step gets an autopsy: the first ``autopsy_max_steps`` do, and
    under ``auto`` (`policy`, a hook's override, or ``nan_policy``) every one (its triage
    chooses), unless that is 0."""
    policy = config.nan_policy if policy is None else policy
    auto = policy == Action.AUTO and config.autopsy_max_steps > 0
    return auto or state.autopsies < config.autopsy_max_steps


def counted(state: GuardState, step: int) -> GuardState:
    """The state once a bad step at global step `step` is counted, before any decision (what
    ``on_nan`` is shown): the run of bad steps starts over when the global step moved."""
    moved = state.last_bad_step is not None and step >= 0 and step != state.last_bad_step
    consecutive = 0 if moved else state.consecutive_bad_steps
    if consecutive == 0:
        state = replace(state, run_start=step, reason_run=())
    return replace(
        state,
        total_bad_steps=state.total_bad_steps + 1,
        consecutive_bad_steps=consecutive + 1,
        last_bad_step=step,
    )


def decide(
    config: GuardConfig, state: GuardState, observation: Observation
) -> Tuple[Optional[Decision], GuardState]:
    """The guard's one transition, pure: ``(decision, next_state)``, the decision None but for a
    `BadStep` or a `RollbackRequested`; raises TypeError for anything else. Every counting rule
    is here: runs of bad steps and their escalation, ``max_rollbacks`` (a chief's answers to
    requests included), new levels and their probation."""
    if isinstance(observation, GoodStep):
        return None, replace(
            state, steps=state.steps + 1, consecutive_bad_steps=0, run_start=None, reason_run=()
        )
    if isinstance(observation, LossScaleOverflow):
        return None, replace(state, loss_scale_overflows=state.loss_scale_overflows + 1)
    if isinstance(observation, RolledBack):
        scale = observation.learning_rate_scale
        return None, replace(state, rollbacks=state.rollbacks + 1, learning_rate_scale=scale)
    if isinstance(observation, Retried):
        if not observation.trained:
            return None, replace(state, skips=state.skips + 1)
        return None, replace(state, retries=state.retries + 1, last_bad_step=observation.step)
    if isinstance(observation, RollbackAsked):
        return None, replace(state, rollback_requests=state.rollback_requests + 1)
    if isinstance(observation, RollbackRequested):
        return _decide_request(config, state, observation.workers), state
    if isinstance(observation, BadStep):
        return _decide_bad(config, state, observation)
    raise TypeError(f"decide got {observation!r}, which is no observation; see Observation.")


def _decide_bad(
    config: GuardConfig, state: GuardState, observation: BadStep
) -> Tuple[Decision, GuardState]:
    """`decide` for a bad step: a probation's divergence, a new level, or the policy."""
    state = counted(state, observation.step)
    state = replace(state, autopsies=state.autopsies + observation.autopsied)
    choice = None if observation.choose is None else observation.choose(state, observation)
    if choice is not None:
        observation = replace(observation, chosen=Action(choice))
    counts = {"consecutive": state.consecutive_bad_steps, "total": state.total_bad_steps}
    cause = observation.cause
    if cause != NON_FINITE:
        tally = dict(state.rejected)
        state = replace(state, rejected=tuple({**tally, cause: tally.get(cause, 0) + 1}.items()))
    decision = None
    if observation.reason is not None and observation.guarded:
        decision, state = observation.reason.decide(config, state, observation)
    else:
        state = replace(state, reason_run=())
    if decision is None:
        decision = _decide_policy(config, state, observation)
    if decision.action == Action.SKIP and not decision.retry:  # A retry's count is `Retried`'s.
        state = replace(state, skips=state.skips + 1)
    elif decision.action == Action.STOP:
        state = replace(state, stops=state.stops + 1)
    elif decision.action == Action.ROLLBACK and decision.escalation:
        state = replace(state, consecutive_bad_steps=0)
    return replace(decision, **counts), state


def rollbacks_done(config: GuardConfig, state: GuardState) -> str:
    """Why a rollback cannot be done: ``max_rollbacks`` reached."""
    return f"{state.rollbacks} rollbacks already done reached max_rollbacks={config.max_rollbacks}"


def _decide_policy(config: GuardConfig, state: GuardState, observation: BadStep) -> Decision:
    """The chosen policy, or its escalation; a loss no guarded train op made had nothing gated,
    so it can only raise (saying so) or stop."""
    if not observation.guarded:
        if observation.chosen != Action.RAISE:
            return Decision(Action(observation.chosen))
        return Decision(
            Action.RAISE,
            reason="the loss comes from no guarded train op, so the update of this step may "
            "already have happened",
            give_up=Cause.UNGUARDED_LOSS,
        )
    action, escalation, reason = Action(observation.chosen), "", ""
    retry = action == Action.AUTO and observation.verdict == "chance"
    quarantine = action == Action.AUTO and observation.verdict == "data"
    if action == Action.AUTO:
        action = AUTO_ACTIONS.get(observation.verdict, Action.SKIP)
    cause, limit = Cause.POLICY, None
    consecutive = state.consecutive_bad_steps
    if action in (Action.SKIP, Action.ROLLBACK) and consecutive >= config.max_consecutive_bad_steps:
        # The state is bad, not the batch: escalate (raise by default).
        reason = escalation = (
            f"{consecutive} bad steps in a row reached "
            f"max_consecutive_bad_steps={config.max_consecutive_bad_steps}"
        )
        action = Action(config.persistent_nan_policy)
        cause, limit = Cause.MAX_CONSECUTIVE_BAD_STEPS, config.max_consecutive_bad_steps
    if action == Action.ROLLBACK and state.rollbacks >= config.max_rollbacks:
        bound = rollbacks_done(config, state)
        reason = f"{reason}, and {bound}" if reason else bound
        action = Action.RAISE
        cause, limit = Cause.MAX_ROLLBACKS, config.max_rollbacks
    if action != Action.RAISE:
        kept = action == Action.SKIP and not escalation
        return Decision(action, escalation, retry=retry and kept, quarantine=quarantine and kept)
    policy = "nan_policy" if observation.cause == NON_FINITE else f"{observation.cause}_policy"
    return Decision(action, escalation, reason or f"the {policy} is 'raise'", cause, limit)


def _decide_request(config: GuardConfig, state: GuardState, workers: Tuple[int, ...]) -> Decision:
    """A cluster chief's answer to rollback requests: one rollback, within ``max_rollbacks``."""
    if state.rollbacks < config.max_rollbacks:
        return Decision(Action.ROLLBACK)
    return Decision(
        Action.RAISE,
        reason=f"worker {', '.join(map(str, workers))} asked for a rollback, and "
        f"{rollbacks_done(config, state)}",
        give_up=Cause.MAX_ROLLBACKS,
        limit=config.max_rollbacks,
    )
