"""Issue 35, the quarantine: under ``nan_policy="auto"`` an example the triage blames is written
to the train dir's quarantine file, and an input filtered with `slim_nanguard.quarantine`
never yields it again: later in the same run, after a resume, or in a new pipeline."""

import numpy as np
import tensorflow as tf

import slim_nanguard
from slim_nanguard import _triage
from slim_nanguard import quarantine

import nanguard_testlib as lib

N, BATCH, FEATURES, BAD_ID = 48, 8, 4, 21


def _examples():
    """N examples ``(x, id)``: x uniform in [0.5, 1.5), except example BAD_ID's NaN."""
    x = np.random.RandomState(0).uniform(0.5, 1.5, (N, FEATURES)).astype(np.float32)
    x[BAD_ID, 1] = np.nan
    return x, np.array([f"ex-{i}".encode() for i in range(N)])


def _pipeline(train_dir, *, repeat=True):
    """A user's input: shuffled examples, filtered by the quarantine, then batched."""
    dataset = tf.data.Dataset.from_tensor_slices(_examples())
    dataset = dataset.shuffle(N, seed=3, reshuffle_each_iteration=True)
    dataset = dataset.repeat() if repeat else dataset
    dataset = quarantine.filter_dataset(dataset, str(train_dir))
    return dataset.batch(BATCH, drop_remainder=repeat)


def _train(train_dir, mode, steps, nan_policy="auto"):
    """The user's script: the loss reads x (not the id) of the filtered pipeline's batches."""
    with tf.Graph().as_default():
        x, _ = tf.compat.v1.data.make_one_shot_iterator(_pipeline(train_dir)).get_next()
        w = tf.compat.v1.get_variable("w", [FEATURES], initializer=tf.ones_initializer())
        loss = tf.reduce_mean(tf.reduce_sum(tf.square(x * w), axis=1))
        train_op = slim_nanguard.create_train_op(
            loss,
            tf.compat.v1.train.GradientDescentOptimizer(0.01),
            check_numerics=lib.MODES[mode],
            nan_policy=nan_policy,
        )
        return slim_nanguard.train(
            train_op,
            str(train_dir),
            number_of_steps=steps,
            save_checkpoint_steps=10,
            save_summaries_steps=None,
            log_every_n_steps=0,
        )


def _ids_of_one_epoch(train_dir):
    with tf.Graph().as_default():
        _, ids = tf.compat.v1.data.make_one_shot_iterator(
            _pipeline(train_dir, repeat=False)
        ).get_next()
        seen = []
        with tf.compat.v1.Session() as session:
            try:
                while True:
                    seen += [i.decode() for i in session.run(ids)]
            except tf.errors.OutOfRangeError:
                return seen


@lib.each_mode
def test_a_bad_example_is_met_once_in_eight_epochs_and_never_again_after_a_resume(
    tmp_path, mode, caplog
):
    """Example 21 is NaN in every epoch. auto skips its first batch and quarantines it; the
    same run's pipeline leaves it out of the next seven epochs (one bad step, not eight), a
    resumed run (even under skip) reads the file back, and a new pipeline never yields it."""
    train_dir = tmp_path / "run"
    result = _train(train_dir, mode, steps=6 * 8)  # 8 epochs of 6 batches.
    bad = [r for r in slim_nanguard.read_events(str(train_dir)) if r["kind"] == "bad_step"]
    assert [(r["autopsy"]["triage"]["verdict"], r["action"]) for r in bad] == [("data", "skip")]
    assert (result.global_step, result.bad_steps) == (48, 1)

    (held,) = quarantine.read(str(train_dir))
    x, _ = _examples()
    # The batch is each output of the iterator the loss reads from: x and the id.
    assert held["fingerprint"] == quarantine.fingerprint([x[BAD_ID], f"ex-{BAD_ID}".encode()])
    assert [c["dtype"] for c in held["components"]] == ["float32", "string"]
    assert held["ids"] == {"IteratorGetNext:1": f"ex-{BAD_ID}"}
    assert held["step"] == bad[0]["step"]
    row = bad[0]["autopsy"]["triage"]["examples"][0]
    said = [r.getMessage() for r in caplog.records if "quarantined example" in r.getMessage()]
    assert said == [
        f"slim_nanguard: global step {held['step']}: quarantined example {row} (fingerprint "
        f"{held['fingerprint']}) of the batch in {train_dir}/nanguard_quarantine.jsonl; an input "
        "filtered with slim_nanguard.quarantine.filter_dataset leaves it out from now on."
    ]
    kinds = [r["kind"] for r in slim_nanguard.read_events(str(train_dir))]
    assert kinds.count("quarantine") == 1
    # slim-nanguard-autopsy's report states the verdict and its evidence.
    report = slim_nanguard.autopsy.format_report(bad[0])
    assert f"triage: data — the batch without example {row} " in report
    assert f"is finite (fingerprints {held['fingerprint']})" in report

    quarantine._LIVE.clear()  # As a new process: what it knows comes from the file.
    resumed = _train(train_dir, mode, steps=48 + 6 * 4, nan_policy="skip")
    assert (resumed.global_step, resumed.bad_steps) == (72, 0)
    seen = _ids_of_one_epoch(train_dir)
    assert sorted(seen) == sorted(f"ex-{i}" for i in range(N) if i != BAD_ID)


def test_a_row_of_a_batch_and_the_example_alone_have_one_fingerprint():
    """The triage hashes a batch row across the batch arrays in the iterator's order (strings
    too); the filter hashes the example's components in the same order."""
    with tf.Graph().as_default():
        images = tf.compat.v1.placeholder(tf.float32, name="IteratorGetNext")
        labels = tf.compat.v1.placeholder(tf.string, name="labels")
    x = np.arange(24, dtype=np.float32).reshape(4, 3, 2)
    names = np.array([b"a", b"bb", b"", b"ccc"], dtype=object)
    feeds = {labels: names, images: x}
    found = _triage.identify(feeds, [1, 3], 4)
    assert found["fingerprints"] == {
        "1": quarantine.fingerprint([x[1], b"bb"]),
        "3": quarantine.fingerprint([x[3], b"ccc"]),
    }
    assert found["components"] == [
        {"tensor": "IteratorGetNext:0", "dtype": "float32", "shape": [3, 2]},
        {"tensor": "labels:0", "dtype": "string", "shape": []},
    ]
    assert found["ids"] == {"1": {"labels:0": "bb"}, "3": {"labels:0": "ccc"}}
    assert _triage.identify(feeds, [3], 4)["ids"] == {"3": {"labels:0": "ccc"}}
    # A string that ends in NUL bytes keeps them on both sides (numpy's bytes arrays drop them).
    nul = np.array([b"a\x00", b"a"], dtype=object)
    assert _triage.identify({labels: nul}, [0, 1], 2)["fingerprints"] == {
        "0": quarantine.fingerprint([np.array(b"a\x00", dtype=object)]),
        "1": quarantine.fingerprint([b"a"]),
    }
    assert quarantine.fingerprint([b"a\x00"]) != quarantine.fingerprint([b"a"])
    # Strings are length-prefixed: moving a byte between components changes the fingerprint.
    assert quarantine.fingerprint([b"ab", b"c"]) != quarantine.fingerprint([b"a", b"bc"])


def _triage_of(x_row_print, row=2):
    return {
        "verdict": "data",
        "examples": [row],
        "fingerprints": {str(row): x_row_print},
        "components": [{"tensor": "it:0", "dtype": "float32", "shape": [FEATURES]}],
        "ids": {str(row): {"it:1": 7}},
    }


def test_the_list_is_a_file_of_lines_to_read_edit_and_clear_on_any_file_system(caplog):
    """On ram:// (as on gs://): one line per example, the same example once; a line a user
    broke is passed over with a warning; a task's own file; clear removes them all."""
    directory = "ram://quarantine_story"
    x, _ = _examples()
    first, second = quarantine.fingerprint([x[BAD_ID]]), quarantine.fingerprint([x[3]])
    assert quarantine.read(directory) == []
    assert quarantine.add(directory, None, 12, _triage_of(first)) == [first]
    assert quarantine.add(directory, None, 30, _triage_of(first)) == []  # Held already.
    assert quarantine.add(directory, 2, 31, _triage_of(second)) == [second]
    assert tf.io.gfile.exists(f"{directory}/nanguard_quarantine.task2.jsonl")
    held = quarantine.read(directory)
    assert [(r["fingerprint"], r["step"], r.get("task")) for r in held] == [
        (first, 12, None),
        (second, 31, 2),
    ]
    assert held[0]["ids"] == {"it:1": 7} and held[0]["row"] == 2

    with tf.io.gfile.GFile(quarantine.path(directory), "a") as f:
        f.write('{"fingerprint": oops\n')
        f.write('{"fingerprint": "ab", "components": [{"dtype": "float32"}]}\n')  # no shape
        f.write('{"fingerprint": "cd", "time": "noon"}\n')
    assert len(quarantine.read(directory)) == 2
    for line in (2, 3, 4):
        assert f"skipping unreadable line {line} of {quarantine.path(directory)}" in caplog.text
    assert quarantine.clear(directory) == 2
    assert quarantine.read(directory) == [] and not tf.io.gfile.glob(f"{directory}/*")


def test_the_filter_finds_the_hashed_components_among_more_and_learns_live(tmp_path):
    """The example's components that were hashed (x, not the id) are found by dtype and shape
    in order; an example quarantined after the pipeline started is left out from then on."""
    directory = str(tmp_path)
    x, ids = _examples()
    with tf.Graph().as_default():
        dataset = quarantine.filter_dataset(tf.data.Dataset.from_tensor_slices((x, ids)), directory)
        next_id = tf.compat.v1.data.make_initializable_iterator(dataset)
        element = next_id.get_next()
        with tf.compat.v1.Session() as session:

            def epoch():
                session.run(next_id.initializer)
                seen = []
                try:
                    while True:
                        seen.append(session.run(element)[1].decode())
                except tf.errors.OutOfRangeError:
                    return seen

            assert len(epoch()) == N
            quarantine.add(directory, None, 5, _triage_of(quarantine.fingerprint([x[9]])))
            assert "ex-9" not in epoch() and len(epoch()) == N - 1
            quarantine.clear(directory)
            assert len(epoch()) == N


def test_the_launcher_filters_only_under_auto_or_with_a_quarantine_in_the_train_dir(tmp_path):
    """A seeded run under another policy, with no quarantine, builds its input as before."""
    from slim_nanguard import app
    from slim_nanguard.app import build

    config = app.TrainConfig.from_flags(
        train_dir=str(tmp_path / "run"), dataset_name="synthetic", batch_size=16
    )

    def filters(quarantined):
        built = build.build_training(config, resume=False, quarantine=quarantined)
        return "PyFunc" in set(_dataset_function_ops(built.graph))

    assert not filters(False) and filters(True)


def _dataset_function_ops(graph):
    """The ops of every function in `graph`'s library (tf.data's map and filter bodies)."""
    for function in graph.as_graph_def().library.function:
        for node in function.node_def:
            yield node.op


def test_a_queue_pipeline_leaves_a_quarantined_example_out_with_keep_input(tmp_path):
    """tf-slim's queue pipelines batch with tf.compat.v1.train.batch; maybe_batch with the
    predicate as keep_input leaves the quarantined example out of every batch."""
    directory = str(tmp_path)
    x, ids = _examples()
    quarantine.add(directory, None, 5, _triage_of(quarantine.fingerprint([x[30]])))
    with tf.Graph().as_default():
        one_x, one_id = tf.compat.v1.train.slice_input_producer(
            [x, ids], num_epochs=1, shuffle=False
        )
        keep = quarantine.keep(directory)
        _, batch_ids = tf.compat.v1.train.maybe_batch(
            [one_x, one_id],
            keep_input=keep(one_x, one_id),
            batch_size=BATCH,
            allow_smaller_final_batch=True,
        )
        seen = []
        with tf.compat.v1.train.MonitoredSession() as session:
            while not session.should_stop():
                seen += [i.decode() for i in session.run(batch_ids)]
    assert sorted(seen) == sorted(f"ex-{i}" for i in range(N) if i != 30)
