"""The spike guard's bench and the evidence for its judgement tell the truth about themselves.

``research/spike_bench.py --quick`` trains a clean run (label noise) and the planted spike with
the real guard and without it: its table must have one row per run with every column, list
every flagged step with its z-scores, and its sentences (each row's verdict, the README's
summary) must say what its numbers say. The candidate rules of ``research/spike_rules.py`` are
checked on small stories of accepted and rejected values: a level shift, a divergence, one
spike, a fixed-batch repeat, and an outlier inside the warm-up.
"""

import math
import os
import re
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "research"))

import spike_rules  # noqa: E402

import nanguard_testlib as lib  # noqa: E402


@pytest.fixture(scope="module")
def quick_table(tmp_path_factory):
    """The stdout of ``spike_bench.py --quick``: (header, rows by run, the summary line)."""
    lines, cells = lib.run_table_script(
        "spike_bench.py", "--quick", f"--workdir={tmp_path_factory.mktemp('bench')}"
    )
    header, rows = cells[0], cells[1:]
    return header, {r[0]: dict(zip(header, r)) for r in rows}, lines[-1]


def test_the_quick_bench_prints_a_row_per_run_with_every_column(quick_table):
    import spike_bench

    header, rows, _ = quick_table
    assert tuple(header) == spike_bench.COLUMNS
    assert set(rows) == set(spike_bench.QUICK)
    assert all(len(row) == len(header) for row in rows.values())


def test_the_planted_spike_is_listed_with_its_z_scores_and_rejected(quick_table):
    _, rows, _ = quick_table
    planted = rows["planted"]
    count, listed = planted["flagged (batch: z loss / z grad norm)"].split(": ", 1)
    flags = re.findall(r"(\d+): ([0-9.]+) / ([0-9.]+)", listed)
    assert int(count) == len(flags)
    step, z_loss, z_norm = flags[0]
    assert step == "100" and max(float(z_loss), float(z_norm)) > 6
    assert planted["verdict"].startswith("every planted spike past the warm-up rejected")
    assert f"{len(flags)} step" in planted["verdict"]


def test_each_verdict_says_what_its_numbers_say(quick_table):
    _, rows, _ = quick_table
    for row in rows.values():
        flagged = row["flagged (batch: z loss / z grad norm)"]
        count = 0 if flagged == "0" else int(flagged.split(":")[0])
        verdict = row["verdict"]
        assert ("no step flagged" in verdict) == (count == 0), row
        if count:
            assert f"{count} step" in verdict, row
        ended = row["ended, guarded / unguarded"].split(" / ")[0]
        assert ("ran to its step limit" in verdict) == (ended == "step_limit"), row
        if row["kind"] == "clean":
            ratio = float(row["ratio"])
            assert math.isclose(
                ratio, float(row["guarded"]) / float(row["held-out loss, unguarded"]), rel_tol=2e-3
            )
            percent = round(abs(ratio - 1) * 100)
            said = "equal" if ratio == 1 else f"{percent}% {'worse' if ratio > 1 else 'better'}"
            assert f"final loss {said}" in verdict, row
            assert ("(within 5%)" in verdict) == (ratio <= 1.05), row
            # A clean run with flags is read against its control; one without has none.
            assert (row["control ratio"] == "n/a") == (count == 0), row
            if count:
                control = float(row["control ratio"])
                percent = round(abs(control - 1) * 100)
                said = (
                    "equal"
                    if control == 1
                    else f"{percent}% {'worse' if control > 1 else 'better'}"
                )
                assert f"as many other batches dropped: {said}" in verdict, row


def test_the_readme_sentence_counts_the_clean_rows(quick_table):
    _, rows, sentence = quick_table
    clean = {n: r for n, r in rows.items() if r["kind"] == "clean"}
    flagged = sum(
        0
        if r["flagged (batch: z loss / z grad norm)"] == "0"
        else int(r["flagged (batch: z loss / z grad norm)"].split(":")[0])
        for r in clean.values()
    )
    assert sentence.startswith(f"On {len(clean)} clean-but-hard run")
    assert f"flagged {flagged} step" in sentence
    shifts = sum(
        0 if r["level shifts named"] == "none" else len(r["level shifts named"].split(", "))
        for r in clean.values()
    )
    assert f"named {shifts} level shift" in sentence
    ended = sum(
        1 for r in clean.values() if not r["ended, guarded / unguarded"].startswith("step_limit")
    )
    assert f"ended {ended} before" in sentence
    worst = max(float(r["ratio"]) for r in clean.values())
    assert f"at most {max(0, round((worst - 1) * 100))}% worse" in sentence


# ---------------------------------------------------------------- the candidate rules


def _feed(judge, values, start=0):
    """Feeds ``(loss, norm)`` pairs to `judge`; the actions, in order."""
    return [
        judge.decide(start + i, {"loss": loss, "norm": norm})
        for i, (loss, norm) in enumerate(values)
    ]


def _noisy(n, level=1.0, seed=0):
    import numpy as np

    rng = np.random.RandomState(seed)
    return [
        (level * math.exp(0.1 * a), level * math.exp(0.1 * b)) for a, b in rng.normal(size=(n, 2))
    ]


def test_a_new_level_is_rejected_k_times_then_adapted_and_kept():
    rule = spike_rules.Rule(level_shift=5, live_after_shift=True, probation=True)
    judge = spike_rules.Judge(rule)
    assert set(_feed(judge, _noisy(100))) == {spike_rules.ACCEPT}
    actions = _feed(judge, _noisy(60, level=16.0, seed=1), start=100)
    assert actions[:4] == [spike_rules.SPIKE] * 4
    assert actions[4] == spike_rules.ADAPT
    assert set(actions[5:]) == {spike_rules.ACCEPT}
    (shift,) = [e for e in judge.events if e["kind"] == spike_rules.ADAPT]
    assert shift["from"]["loss"] == pytest.approx(1.0, rel=0.1)
    assert shift["to"]["loss"] == pytest.approx(16.0, rel=0.1)


def test_today_the_same_new_level_stops_the_run_after_ten_rejections():
    judge = spike_rules.Judge(spike_rules.Rule())
    _feed(judge, _noisy(100))
    actions = _feed(judge, _noisy(10, level=16.0, seed=1), start=100)
    assert actions == [spike_rules.SPIKE] * 9 + [spike_rules.STOP]


def test_a_divergence_that_climbs_again_after_the_shift_stops_on_probation():
    rule = spike_rules.Rule(level_shift=5, live_after_shift=True, probation=True)
    judge = spike_rules.Judge(rule)
    _feed(judge, _noisy(100))
    # Rejected steps leave the weights where they were: the values repeat at the new level.
    actions = _feed(judge, _noisy(5, level=20.0, seed=1), start=100)
    assert actions[-1] == spike_rules.ADAPT
    assert judge.decide(105, {"loss": 600.0, "norm": 14.0}) == spike_rules.STOP


def test_without_probation_a_divergence_is_warmed_up_into_the_statistics():
    judge = spike_rules.Judge(spike_rules.Rule(level_shift=5))
    _feed(judge, _noisy(100))
    _feed(judge, _noisy(5, level=20.0, seed=1), start=100)
    assert judge.decide(105, {"loss": 600.0, "norm": 14.0}) == spike_rules.ACCEPT


def test_a_one_off_spike_is_rejected_and_training_goes_on():
    judge = spike_rules.Judge(
        spike_rules.Rule(level_shift=5, live_after_shift=True, probation=True)
    )
    _feed(judge, _noisy(100))
    assert judge.decide(100, {"loss": 30.0, "norm": 1000.0}) == spike_rules.SPIKE
    assert set(_feed(judge, _noisy(50, seed=2), start=101)) == {spike_rules.ACCEPT}


def test_a_jump_repeated_exactly_on_a_fixed_batch_is_moved_past():
    judge = spike_rules.Judge(
        spike_rules.Rule(level_shift=5, live_after_shift=True, probation=True)
    )
    _feed(judge, _noisy(100))
    actions = _feed(judge, [(7.0, 40.0)] * 5, start=100)
    assert actions == [spike_rules.SPIKE] * 4 + [spike_rules.ADAPT]


def test_an_outlier_accepted_in_the_warm_up_blinds_the_mean_but_not_the_trimmed_statistics():
    steps = _noisy(60)
    steps[10] = (1000.0, 1000.0)  # inside the warm-up: accepted
    spike = {"loss": 10.0, "norm": 10.0}  # a x10 spike 50 steps later
    today, trimmed = (
        spike_rules.Judge(spike_rules.Rule()),
        spike_rules.Judge(spike_rules.Rule(center="trim")),
    )
    _feed(today, steps)
    _feed(trimmed, steps)
    assert today.decide(60, spike) == spike_rules.ACCEPT
    assert trimmed.decide(60, spike) == spike_rules.SPIKE


def test_a_bad_shard_as_long_as_k_is_held_back_and_the_old_statistics_return():
    rule = spike_rules.Rule(level_shift=8, live_after_shift=True, probation=True, hold=True)
    judge = spike_rules.Judge(rule)
    _feed(judge, _noisy(100))
    shard = _feed(judge, [(500.0, 900.0)] * 8, start=100)
    assert shard == [spike_rules.SPIKE] * 7 + [spike_rules.SHIFT_HELD]  # none applied
    assert judge.decide(108, {"loss": 1.0, "norm": 1.0}) == spike_rules.ACCEPT
    assert [e["kind"] for e in judge.events][-2:] == [spike_rules.ADAPT, spike_rules.BURST]
    # The old statistics again: a x30 spike is a spike.
    assert judge.decide(109, {"loss": 30.0, "norm": 30.0}) == spike_rules.SPIKE
