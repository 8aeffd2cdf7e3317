"""The guard does not vanish when XLA auto-clustering compiles the graph.

XLA clustering can drop CheckNumerics and Assert ops. This runs a bad step with auto-jit on
(in a subprocess: TF_XLA_FLAGS is read once per process) and checks that XLA really clustered
part of the graph, that the guard's check is still there, and that no variable moved.
"""

import json
import os
import subprocess
import sys
import textwrap

TESTS_DIR = os.path.dirname(os.path.abspath(__file__))

SCRIPT = textwrap.dedent("""
    import json, sys
    sys.path.insert(0, {tests!r})
    import numpy as np
    import tensorflow as tf
    tf.compat.v1.disable_v2_behavior()
    import nanguard_testlib as lib
    import slim_nanguard

    config = tf.compat.v1.ConfigProto()
    config.graph_options.optimizer_options.global_jit_level = tf.compat.v1.OptimizerOptions.ON_1
    report = {{}}
    for mode, check_numerics in lib.MODES.items():
        model = lib.build_model(check_numerics=check_numerics)
        with model.graph.as_default(), tf.compat.v1.Session(config=config) as sess:
            sess.run(tf.compat.v1.global_variables_initializer())
            metadata = tf.compat.v1.RunMetadata()
            sess.run(model.train_op, model.feed(0),
                     options=tf.compat.v1.RunOptions(output_partition_graphs=True),
                     run_metadata=metadata)
            types = [n.op for g in metadata.partition_graphs for n in g.node]
            before = lib.state(sess, model.graph)
            raised = False
            try:
                lib.mark_judged(sess, model.train_op)
                # A NaN loss and a NaN gradient, made alike by every CPU kernel.
                loss = sess.run(model.train_op, model.feed(1, "nan_loss", "nan_gradient"))
            except tf.errors.InvalidArgumentError as err:
                raised = slim_nanguard.is_numerics_error(err)
                loss = None
            after = lib.state(sess, model.graph)
        report[mode] = {{
            "xla_ops": sum("Xla" in t for t in types),
            "check_ops": types.count("CheckNumerics"),
            "raised": raised,
            "loss_finite": None if loss is None else bool(np.isfinite(loss)),
            "changed": [k for k in before if not np.array_equal(before[k], after[k])],
        }}
    print("REPORT", json.dumps(report))
""")


def test_the_guard_holds_under_xla_auto_clustering():
    env = dict(
        os.environ,
        TF_XLA_FLAGS="--tf_xla_cpu_global_jit --tf_xla_auto_jit=2",
        TF_CPP_MIN_LOG_LEVEL="2",
    )
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(tests=TESTS_DIR)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.split("REPORT", 1)[1])
    check, hook = report["check_numerics"], report["hook"]
    assert check["xla_ops"] > 0 and hook["xla_ops"] > 0, "XLA did not cluster anything"
    assert check["check_ops"] == 1 and check["raised"] and check["changed"] == []
    assert hook["loss_finite"] is False and hook["changed"] == []
