"""Prints, for each of model_deploy's layouts on three logical CPU devices (tests/device_layout.py)
and each mode, the transfers between devices of one good step: tf-slim's train op against
slim_nanguard's, without and with the spike test (the ``_Send`` and ``_HostSend`` nodes of
the step's partition graphs).

    python3 .ci/device_sends.py        # from the repository root; about a minute on 2 cores
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import tensorflow as tf  # noqa: E402

tf.compat.v1.disable_v2_behavior()

import device_layout as layouts  # noqa: E402
import test_devices  # noqa: E402

SPIKE = dict(nan_policy="rollback", spike_policy="rollback")


def sends(layout: dict, check_numerics=None, **guard) -> int:
    guarded = check_numerics is not None
    kwargs = dict(check_numerics=check_numerics, **guard) if guarded else {}
    built = layouts.build(guarded=guarded, **layout, **kwargs)
    with test_devices.session_of(built, guarded) as sess:
        sess.run(built.train_op)
        return layouts.run_with_partitions(sess, built.train_op)[1]


def main() -> None:
    print("| layout | tf-slim | check_numerics | hook | check_numerics, spike | hook, spike |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, layout in test_devices.LAYOUTS.items():
        base = sends(layout)
        guarded = [sends(layout, check, **g) for g in ({}, SPIKE) for check in (True, False)]
        cells = " | ".join(f"{n} (+{n - base})" for n in guarded)
        print(f"| {name} | {base} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
