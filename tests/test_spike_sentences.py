"""A spike's sentences agree with their numbers.

A user reads a spike's log line, its autopsy (in the log, the record, the dump and
``slim-nanguard-autopsy``) and the launcher's summary, and checks the words against the figures
printed next to them. Each story reads a sentence as that user would (parsing it) and holds its
words to its own figures and to the record: the examples named as standing out are exactly the
ones the figures shown set apart; "of 32" is the batch, "over the last N accepted steps" the
window the figures are over (not the run's count of accepted steps); and a spike caught on the
gradient norm alone says that the examples with the highest loss are only a guess at its
carriers.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import re
from typing import List, Optional, Sequence, Tuple

import numpy as np
import pytest

import slim_nanguard
from slim_nanguard import _autopsy
from slim_nanguard import _spike
from slim_nanguard import app
from slim_nanguard import autopsy as autopsy_reader
from slim_nanguard.app import report

_LIST = r"\d+(?:, \d+)*"
_NAMED = re.compile(
    rf"examples? (?P<named>{_LIST}) of (?P<batch>\d+)"
    r"(?P<open> and perhaps others with lower losses)?(?P<carried> carried the spike)? "
    rf"\(per-example loss (?P<losses>[^;]+)"
    rf"(?:; next highest: examples? (?P<others>{_LIST}) at (?P<other_losses>[^;]+))?"
    r"; batch median (?P<median>[^)]+)\)"
)
_NONE = re.compile(
    rf"^no example of the batch of (?P<batch>\d+) stands out: the highest per-example losses "
    rf"are examples (?P<others>{_LIST}) \((?P<other_losses>[^;]+); batch median "
    r"(?P<median>[^)]+)\), so (?P<ending>.*)$"
)
_HEDGE = "which may have carried the gradient-norm spike"
_HEDGE_NONE = "the losses name no example that may have carried the gradient-norm spike"
# The ordinary batches of spike_skip.cfg's planted spike (batch 100's images x 1,000), as
# its autopsy found them: two examples with a loss, the other thirty saturated at 0.
SPIKE_SKIP_TOP = ((31, 1043.0288), (8, 100.36084), (0, 0.0), (1, 0.0), (2, 0.0))


@dataclasses.dataclass(frozen=True)
class Reading:
    """What a reader takes from a spike's autopsy sentence."""

    named: Tuple[int, ...]  # the examples said to stand out (to have carried the spike)
    named_losses: Tuple[float, ...]
    others: Tuple[int, ...]  # the other examples shown, highest first
    other_losses: Tuple[float, ...]
    median: float
    batch: int
    hedged: bool  # says the examples are a guess at the spike's carriers
    open_end: bool = False  # says others with lower losses may have carried it too


def _numbers(text: Optional[str]) -> Tuple[float, ...]:
    return tuple(float(x) for x in text.split(", ")) if text else ()


def _indices(text: Optional[str]) -> Tuple[int, ...]:
    return tuple(int(x) for x in text.split(", ")) if text else ()


def read(sentence: str) -> Reading:
    """Parses a spike's autopsy sentence (`_autopsy.explain_spike`); fails on any other."""
    none = _NONE.match(sentence)
    found = none or _NAMED.search(sentence)
    assert found, f"not a sentence naming a spike's examples: {sentence!r}"
    if none:
        hedged = none["ending"].startswith(_HEDGE_NONE)
        assert hedged or none["ending"] == "the batch as a whole carried the spike", sentence
    else:
        hedged = _HEDGE in sentence[: found.start()]
        # Either "carried the spike" outright or the hedge, never both nor neither.
        assert hedged != bool(found["carried"]), sentence
    return Reading(
        named=() if none else _indices(found["named"]),
        named_losses=() if none else _numbers(found["losses"]),
        others=_indices(found["others"]),
        other_losses=_numbers(found["other_losses"]),
        median=float(found["median"]),
        batch=int(found["batch"]),
        hedged=hedged,
        open_end=bool(not none and found["open"]),
    )


def stand_apart(reading: Reading) -> bool:
    """A reader's check that the examples named stand apart, from the figures shown alone.

    The chain is the losses shown, highest first, then the median; zero and negative losses
    (a saturated softmax's 0) are its bottom, 4 times below its lowest positive loss. The named
    ones stand apart when the chain's largest ratio from one figure to the next falls right
    after them and is at least 4; naming none is right when no ratio is that large (or no loss
    is above 0).
    """
    chain = list(reading.named_losses + reading.other_losses) + [reading.median]
    if not chain[0] > 0:
        return not reading.named
    bottom = min(loss for loss in chain if loss > 0) / 4
    chain = [loss if loss > 0 else bottom for loss in chain]
    ratios = [a / b for a, b in zip(chain, chain[1:])]
    largest = max(ratios)
    if not reading.named:
        return largest < 4
    return ratios[len(reading.named) - 1] == largest >= 4


def _sentence(top, median, over=("grad_norm",), batch=32) -> str:
    result = _autopsy.Autopsy(
        cause="spike",
        top_examples=tuple(top),
        batch_size=batch,
        median_loss=median,
        per_example_loss="xentropy:0",
        spike_over=tuple(over),
    )
    return _autopsy.explain_spike(result)


# ---------------------------------------------------------------------- the autopsy's words
def test_the_planted_spike_of_spike_skip_cfg_names_the_examples_that_stand_out():
    """Example 31's loss is 1043, ten times the next (100.4), and the rest of the batch is at
    0: example 31 stands out. The spike was caught on the gradient norm alone (loss z 4.5 <
    6), so the sentence says it may have carried the spike."""
    sentence = _sentence(SPIKE_SKIP_TOP, 0.0)
    reading = read(sentence)
    assert reading.named == (31,) and reading.named_losses == (1043,)
    assert reading.others == (8, 0, 1, 2) and reading.other_losses == (100.4, 0, 0, 0)
    assert (reading.median, reading.batch) == (0.0, 32)
    assert reading.hedged and stand_apart(reading)
    assert sentence.startswith("the example with the highest loss, which may have carried")


def test_a_spike_caught_on_the_loss_says_its_examples_carried_it():
    for over in (("loss",), ("loss", "grad_norm")):
        sentence = _sentence(SPIKE_SKIP_TOP, 0.0, over=over)
        assert sentence.startswith("example 31 of 32 carried the spike (per-example loss 1043;")
        assert not read(sentence).hedged


def test_a_spike_on_the_gradient_norm_alone_hedges_even_when_no_example_stands_out():
    calm = ((4, 0.52), (9, 0.5), (1, 0.49), (7, 0.47), (3, 0.46))
    reading = read(_sentence(calm, 0.41))
    assert reading.hedged and reading.named == () and stand_apart(reading)
    assert not read(_sentence(calm, 0.41, over=("loss",))).hedged


def test_the_loss_that_stands_out_is_judged_on_the_figures_shown():
    """1.00004 and 0.250001 print as 1 and 0.25: the ratio a reader sees is 4, so example 6
    stands out, although the unrounded ratio is just below 4."""
    top = ((6, 1.00004), (2, 0.250011), (5, 0.25), (0, 0.25), (1, 0.25))
    reading = read(_sentence(top, 0.25, over=("loss",)))
    assert reading.named == (6,) and reading.named_losses == (1.0,) and stand_apart(reading)


def test_zeros_negative_and_infinite_losses_are_judged_as_a_reader_would():
    cases = {
        # The loss of two close examples, the rest saturated at 0: both stand out.
        ((3, 812.3), (17, 395.1), (5, 0.0), (1, 0.0), (8, 0.0)): (3, 17),
        # Small losses over zeros do not stand out next to a loss of 1,000.
        ((3, 1000.0), (17, 0.5), (5, 0.4), (1, 0.3), (8, 0.0)): (3,),
        # Two losses far above the rest: both, though the first is 34 times the second.
        ((3, 5.122e5), (17, 1.5e4), (5, 3.832), (1, 3.179), (8, 2.69)): (3, 17),
        # A negative loss (a log-likelihood term) is the bottom too.
        ((3, 50.0), (17, -1.0), (5, -2.0), (1, -2.0), (8, -3.0)): (3,),
        # No loss above 0: nothing to set apart.
        ((3, 0.0), (17, 0.0), (5, -1.0)): (),
        # Infinite losses stand out of finite ones.
        ((3, math.inf), (17, 2.0), (5, 1.0)): (3,),
    }
    for top, named in cases.items():
        median = 0.0 if top[-1][1] >= 0 else top[-1][1]
        reading = read(_sentence(top, median, over=("loss",)))
        assert reading.named == named, (top, reading)
        if not math.isinf(top[0][1]):
            assert stand_apart(reading), (top, reading)


def test_when_every_example_shown_stands_out_the_sentence_leaves_the_end_open():
    """A batch made noisier as a whole (a new level's): the five highest losses are far above
    the median, but the figures shown cannot say whether the sixth (35, not shown) is one of
    them, so the sentence names the five and says others with lower losses may be too. A
    batch of five has no others."""
    top = ((25, 141.0), (30, 117.3), (1, 45.99), (2, 43.06), (29, 38.0))
    sentence = _sentence(top, 5.848, over=("loss",))
    reading = read(sentence)
    assert reading.named == (25, 30, 1, 2, 29) and reading.open_end and stand_apart(reading)
    assert "examples 25, 30, 1, 2, 29 of 32 and perhaps others with lower losses carried" in (
        sentence
    )
    assert not read(_sentence(top, 5.848, over=("loss",), batch=5)).open_end
    assert read(_sentence(top, 5.848)).open_end  # hedged, too


def test_on_many_batches_the_examples_named_are_those_the_figures_set_apart():
    """Batches of 32 with saturated zeros, ties, heavy tails and a planted example or two:
    each sentence, read back, names exactly the examples its own figures set apart, shows the
    five highest in order with their losses as kept, and hedges exactly when the spike was
    caught on the gradient norm alone."""
    rng = np.random.default_rng(25)
    named_some = named_none = 0
    for _ in range(400):
        losses = rng.lognormal(rng.uniform(-3, 1), rng.uniform(0.1, 3), 32)
        if rng.random() < 0.5:
            losses[rng.random(32) < rng.uniform(0, 0.9)] = 0.0  # saturated softmaxes
        for i in rng.choice(32, rng.integers(0, 3), replace=False):
            losses[i] *= 10 ** rng.uniform(0, 4)  # the examples scaled up
        losses = np.round(losses, int(rng.integers(1, 6)))  # ties
        top = _autopsy.rank_examples(losses)
        over = [("loss",), ("grad_norm",), ("loss", "grad_norm")][int(rng.integers(3))]
        reading = read(_sentence(top, _autopsy.median_loss(losses), over=over))
        assert reading.named + reading.others == tuple(i for i, _ in top)
        shown = tuple(_autopsy.shown_loss(loss) for _, loss in top)
        assert reading.named_losses + reading.other_losses == shown
        assert reading.median == _autopsy.shown_loss(_autopsy.median_loss(losses))
        assert reading.batch == 32 and reading.hedged == (over == ("grad_norm",))
        assert stand_apart(reading), reading
        # Every example shown named, of a larger batch: the sentence leaves the end open.
        assert reading.open_end == (reading.named != () and reading.others == ()), reading
        named_some += bool(reading.named)
        named_none += not reading.named
    assert named_some > 50 and named_none > 50  # both sentences were read, many times


# ---------------------------------------------------------------------- the spike's log line
def test_the_log_line_says_the_window_its_figures_are_over_not_the_runs_count():
    """300 accepted steps, figures over the last 128 of them: the line says 128."""
    spike = {
        "loss": 0.9,
        "grad_norm": 921.4,
        "z_loss": 4.5,
        "z_grad_norm": 15.8,
        "typical_loss": 0.37,
        "typical_grad_norm": 1.204,
        "sigma": 6.0,
        "over": ["grad_norm"],
        "accepted_steps": 300,
        "window_steps": 128,
    }
    phrase = _spike.phrase(spike)
    assert _read_spike_phrase(phrase) == _figures_of(spike), phrase


_SPIKE_PHRASE = re.compile(
    r"spike: gradient norm (?P<grad_norm>\S+) is (?P<z_grad_norm>\S+) deviations above the "
    r"typical (?P<typical_grad_norm>\S+) \(spike_sigma=(?P<sigma>\S+), over the last "
    r"(?P<window_steps>\d+) accepted steps; (?P<loss_name>(?:data )?loss) z (?P<z_loss>\S+)\)"
)


def _read_spike_phrase(text: str) -> dict:
    """The figures a reader takes from a gradient-norm spike's log line."""
    found = _SPIKE_PHRASE.search(text)
    assert found, text
    figures = {k: float(v) for k, v in found.groupdict().items() if k != "loss_name"}
    # The loss judged is named a data loss exactly when regularization was taken out of it.
    return figures | {"regularization_terms": found["loss_name"] == "data loss"}


def _figures_of(spike: dict) -> dict:
    """The record's figures, as the log line prints them."""
    fmt = {"grad_norm": ".4g", "typical_grad_norm": ".4g", "z_grad_norm": ".1f", "z_loss": ".1f"}
    figures = {k: float(format(spike[k], f)) for k, f in fmt.items()}
    return figures | {
        "sigma": spike["sigma"],
        "window_steps": float(spike["window_steps"]),
        "regularization_terms": spike.get("regularization_terms", 0) > 0,
    }


# ---------------------------------------------------------------------- a run, end to end
SPIKE_STEP = 140  # past the window of 128 accepted steps


@pytest.fixture(scope="module")
def spiked_run(tmp_path_factory):
    """spike_skip.cfg's run (the digits MLP, batch 32, --spike_policy=skip) with its spike
    planted at batch 140, so that the accepted steps (140) outnumber the window (128), and a
    NaN batch two batches later (a bad step that is no spike)."""
    train_dir = tmp_path_factory.mktemp("spiked")
    config = app.TrainConfig.from_flags(
        train_dir=str(train_dir),
        model_name="mlp",
        dataset_name="digits",
        batch_size=32,
        max_number_of_steps=SPIKE_STEP + 5,
        optimizer="momentum",
        learning_rate=0.05,
        learning_rate_decay_type="fixed",
        weight_decay=0.00004,
        log_every_n_steps=0,
        save_summaries_steps=0,
        save_summaries_secs=0,
        check_numerics=True,
        nan_policy="skip",
        inject_faults=f"spike_input:{SPIKE_STEP},nan_input:{SPIKE_STEP + 2}",
        spike_policy="skip",
        seed=0,
    )
    handler = _Lines()
    logger = logging.getLogger("tensorflow")
    logger.addHandler(handler)
    try:
        result = app.run_training(config)
    finally:
        logger.removeHandler(handler)
    bad = [r for r in slim_nanguard.read_events(str(train_dir)) if r["kind"] == "bad_step"]
    assert [(r["step"], r["cause"]) for r in bad] == [
        (SPIKE_STEP, "spike"),
        (SPIKE_STEP + 1, "non_finite"),
    ]
    return train_dir, config, result, bad[0], handler.lines


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: List[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def _line(lines: Sequence[str], opening: str) -> str:
    (line,) = [line for line in lines if opening in line]
    return line


def test_a_runs_spike_line_states_the_records_figures(spiked_run):
    _, _, _, record, lines = spiked_run
    spike = record["spike"]
    assert record["step"] == SPIKE_STEP and record["cause"] == "spike"
    assert (spike["accepted_steps"], spike["window_steps"]) == (SPIKE_STEP, 128)
    line = _line(lines, "Model diverging: a spike")
    if spike["over"] == ["grad_norm"]:  # as on the CPUs we know; else only the counts below
        assert _read_spike_phrase(line) == _figures_of(spike), line
    assert "over the last 128 accepted steps" in line, line
    # The MLP's weight decay is taken out of the loss judged: the record says by how much.
    assert spike["regularization_terms"] == 3, spike  # fc1, fc2, logits
    assert math.isclose(
        spike["loss"] + spike["regularization_loss"], spike["total_loss"], rel_tol=1e-6
    ), spike
    assert math.isclose(spike["total_loss"], record["loss"], rel_tol=1e-6), (spike, record)
    consecutive, total = re.search(r"bad step (\d+) in a row \((\d+) in all\)", line).groups()
    assert (int(consecutive), int(total)) == (record["consecutive"], record["total"]) == (1, 1)


def test_a_runs_autopsy_reads_the_same_in_the_log_the_record_the_dump_and_the_command(
    spiked_run,
):
    train_dir, _, _, record, lines = spiked_run
    autopsy = record["autopsy"]
    sentence = autopsy["summary"]
    logged = _line(lines, f"autopsy of global step {SPIKE_STEP}:")
    assert f"slim_nanguard: autopsy of global step {SPIKE_STEP}: {sentence} (dump: " in logged
    with open(autopsy["dump"]) as f:
        assert json.load(f)["summary"] == sentence
    shown = autopsy_reader.format_report(autopsy_reader.find_bad_step(str(train_dir), SPIKE_STEP))
    assert f"  autopsy     {sentence}\n" in shown
    # Why the finite step was rejected: the log line's own words, in the record and the command.
    assert record["why"].startswith("spike: ") and record["why"] in _line(lines, "Model diverging")
    assert f"  rejected    {record['why']}\n" in shown
    replayed = autopsy_reader.replay_dump(autopsy["dump"], str(train_dir))
    assert replayed.describe() == sentence
    # Its words agree with its figures and with the record's.
    reading = read(sentence)
    assert stand_apart(reading) and reading.batch == autopsy["batch_size"] == 32
    top = [(i, _autopsy.shown_loss(loss)) for i, loss in autopsy["top_examples"]]
    shown = zip(reading.named + reading.others, reading.named_losses + reading.other_losses)
    assert list(shown) == top
    assert reading.median == _autopsy.shown_loss(autopsy["median_loss"])
    assert reading.hedged == (record["spike"]["over"] == ["grad_norm"])


def test_an_old_dump_without_spike_over_hedges_from_the_record(spiked_run):
    """A record written before the autopsy kept what the spike was caught on: the command takes
    it from the record's spike, so it hedges as the log line did."""
    train_dir, _, _, record, _ = spiked_run
    old = dict(record, autopsy={k: v for k, v in record["autopsy"].items() if k != "spike_over"})
    old["spike"] = dict(record["spike"], over=["grad_norm"])
    assert read(_autopsy_line(autopsy_reader.format_report(old))).hedged
    old["spike"] = dict(record["spike"], over=["loss"])
    assert not read(_autopsy_line(autopsy_reader.format_report(old))).hedged


def _autopsy_line(shown: str) -> str:
    (line,) = [line for line in shown.splitlines() if line.startswith("  autopsy     ")]
    return line[len("  autopsy     ") :]


def test_the_launchers_summary_counts_the_spikes_of_the_record(spiked_run):
    """Two bad steps, one of them a spike: the summary says so, as the record does."""
    train_dir, config, result, record, _ = spiked_run
    records = [r for r in slim_nanguard.read_events(str(train_dir)) if r["kind"] == "bad_step"]
    summary = report.describe_training(result, config)
    spikes, policy, sigma = re.search(
        r"^  spikes +(\d+) of the bad steps \(--spike_policy=(\w+), --spike_sigma=(\S+)\)$",
        summary,
        re.M,
    ).groups()
    bad = int(re.search(r"^  bad steps +(\d+) ", summary, re.M).group(1))
    assert bad == result.bad_steps == len(records) == 2
    assert int(spikes) == result.spikes == sum(r["cause"] == "spike" for r in records) == 1
    assert policy == config.guard.spike_policy == "skip"
    assert float(sigma) == config.guard.spike_sigma == record["spike"]["sigma"]


_DATA_LOSS_PHRASE = re.compile(
    r"spike: data loss (?P<loss>\S+) \(total loss (?P<total_loss>\S+) less regularization "
    r"(?P<regularization_loss>\S+)\) is (?P<z_loss>\S+) deviations above the typical "
    r"(?P<typical_loss>\S+) \(spike_sigma=6, over the last 128 accepted steps; gradient norm "
    r"z (?P<z_grad_norm>\S+)\)"
)


@pytest.mark.parametrize("seed", range(20))
def test_a_data_loss_spike_says_what_was_judged_and_its_numbers_add_up(seed):
    """A spike over the data loss (weight decay taken out, issue 33) names it a data loss and
    shows the total and the regularization it was taken from, which add up as printed."""
    rng = np.random.default_rng(seed)
    regularization = 10 ** rng.uniform(-3, 1)
    data = regularization * 10 ** rng.uniform(-4, 1)
    report = {
        "loss": data,
        "grad_norm": 2.0,
        "z_loss": rng.uniform(6.01, 30),
        "z_grad_norm": rng.uniform(0, 5.9),
        "typical_loss": data / 10,
        "typical_grad_norm": 2.0,
        "sigma": 6.0,
        "over": ["loss"],
        "accepted_steps": 300,
        "window_steps": 128,
        "total_loss": data + regularization,
        "regularization_loss": regularization,
        "regularization_terms": 4,
    }
    found = _DATA_LOSS_PHRASE.search(_spike.phrase(report))
    assert found, _spike.phrase(report)
    read = {k: float(v) for k, v in found.groupdict().items()}
    for key, value in read.items():
        assert value == float(format(report[key], ".1f" if key.startswith("z_") else ".4g"))
    # Four digits each: the data loss is the total less the regularization, to their rounding.
    slack = 5e-4 * (read["total_loss"] + read["regularization_loss"] + read["loss"])
    assert abs(read["total_loss"] - read["regularization_loss"] - read["loss"]) <= slack
    # Without regularization taken out, the same spike is the loss's, as before.
    plain = {k: v for k, v in report.items() if "regularization" not in k and k != "total_loss"}
    assert _spike.phrase(plain).startswith(f"spike: loss {data:.4g} is ")


@pytest.mark.parametrize(
    "z, written",
    [(6.04, "6.04"), (5.96, "5.96"), (15.83, "15.8"), (3.39, "3.4"), (6.0004, "6.0004")],
)
def test_a_z_score_next_to_sigma_is_written_on_its_side_of_it(z, written):
    report = {
        "loss": 35.7,
        "grad_norm": 2.0,
        "z_loss": z,
        "z_grad_norm": 1.0,
        "typical_loss": 1.0,
        "typical_grad_norm": 2.0,
        "sigma": 6.0,
        "over": ["loss"] if z > 6 else [],
        "accepted_steps": 300,
        "window_steps": 128,
    }
    phrase = _spike.phrase(report)
    assert (f"is {written} deviations above" if z > 6 else f"loss z {written}") in phrase
