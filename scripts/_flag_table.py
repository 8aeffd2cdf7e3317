"""The launchers' flags, for `_quiet_start.check_flags_early` (no TensorFlow).

Written by ``python3 scripts/_quiet_start.py``; tests/test_fast_flags.py checks it against the
launchers' own definitions.
"""

FLAGS = {
    "common": {
        "delta_threshold": {"type": "float"},
        "hbm_oom_exit": {"type": "bool"},
        "op_conversion_fallback_to_while_loop": {"type": "bool"},
        "runtime_oom_exit": {"type": "bool"},
        "test_random_seed": {"type": "int"},
        "test_randomize_ordering_seed": {"type": "string"},
        "test_srcdir": {"type": "string"},
        "test_tmpdir": {"type": "string"},
        "tt_check_filter": {"type": "bool"},
        "tt_single_core_summaries": {"type": "bool"},
        "xml_output_file": {"type": "string"},
    },
    "train": {
        "adadelta_rho": {"type": "float", "help": "Adadelta's rho.", "default": 0.95},
        "adagrad_initial_accumulator_value": {
            "type": "float",
            "help": "Adagrad's initial accumulator.",
            "default": 0.1,
        },
        "adam_beta1": {"type": "float", "help": "Adam's beta1.", "default": 0.9},
        "adam_beta2": {"type": "float", "help": "Adam's beta2.", "default": 0.999},
        "autopsy_keep_first": {
            "type": "int",
            "help": "Autopsy dumps kept in --train_dir from the first bad steps (the oldest).",
            "default": 3,
        },
        "autopsy_keep_last": {
            "type": "int",
            "help": "Autopsy dumps kept in --train_dir from the latest bad steps (at least 1).",
            "default": 3,
        },
        "autopsy_max_steps": {
            "type": "int",
            "help": "How many bad steps get an autopsy: "
            "the step replayed from its kept "
            "batch to name the first op that made "
            "a NaN or Inf (slim-nanguard-autopsy "
            "shows it); 0: none, and no batch is "
            "kept.",
            "default": 3,
            "lower": 0,
        },
        "autopsy_timeout_secs": {
            "type": "float",
            "help": "Seconds an autopsy's replay may "
            "take before it is given up "
            "(training goes on).",
            "default": 60.0,
        },
        "batch_size": {"type": "int", "help": "Examples per step.", "default": 32, "lower": 1},
        "check_numerics": {
            "type": "bool",
            "help": "The guard's mode: a bad step raises "
            "inside the step (check_numerics mode); "
            "--nocheck_numerics lets a session hook "
            "see it (hook mode). Both write nothing "
            "on a bad step.",
            "default": True,
        },
        "checkpoint_exclude_scopes": {
            "type": "list",
            "help": "Comma-separated variable "
            "scopes not restored from "
            "--checkpoint_path (e.g. "
            "MLP/logits).",
            "default": [],
        },
        "checkpoint_path": {
            "type": "string",
            "help": "Fine-tune from this checkpoint (prefix "
            "or directory); ignored when "
            "--train_dir already holds a "
            "checkpoint.",
            "default": None,
        },
        "clip_gradient_norm": {
            "type": "float",
            "help": "Clip each gradient to this norm (0: off).",
            "default": 0.0,
        },
        "dataset_dir": {
            "type": "string",
            "help": "Directory of the TFRecord files (tfrecord only).",
            "default": None,
        },
        "dataset_name": {
            "type": "enum",
            "help": "<digits|synthetic|tfrecord>: digits: UCI "
            "8x8 digits shipped with the package "
            "(offline); synthetic: a generated toy "
            "problem; tfrecord: TF-Slim TFRecords in "
            "--dataset_dir.",
            "default": "digits",
            "choices": ["digits", "synthetic", "tfrecord"],
        },
        "dataset_split_name": {
            "type": "string",
            "help": "The split to train on.",
            "default": "train",
        },
        "end_learning_rate": {
            "type": "float",
            "help": "Where polynomial decay ends.",
            "default": 0.0001,
        },
        "eval_split_name": {
            "type": "string",
            "help": "After training, evaluate the final checkpoint on this split ('' to skip).",
            "default": "test",
        },
        "ftrl_initial_accumulator_value": {
            "type": "float",
            "help": "FTRL's initial accumulator.",
            "default": 0.1,
        },
        "ftrl_l1": {"type": "float", "help": "FTRL's L1 regularization.", "default": 0.0},
        "ftrl_l2": {"type": "float", "help": "FTRL's L2 regularization.", "default": 0.0},
        "ftrl_learning_rate_power": {
            "type": "float",
            "help": "FTRL's learning-rate power.",
            "default": -0.5,
        },
        "ignore_missing_vars": {
            "type": "bool",
            "help": "Leave variables missing from "
            "--checkpoint_path initialised "
            "instead of failing.",
            "default": False,
        },
        "inject_fault": {
            "type": "list",
            "help": "Faults to inject, KIND:STEP or "
            "KIND:FIRST-LAST, comma-separated; KIND is "
            "one of nan_input, inf_input, spike_input, "
            "nan_loss, inf_loss, nan_gradient, "
            "transient_nan, nan_example, "
            "spike_example, lr_jump; STEP counts "
            "batches from 0 (in a fresh run, the "
            "global step of the bad step), or for "
            "nan_example and spike_example an "
            "example's position in the split, bad in "
            "every epoch.",
            "default": [],
        },
        "job_name": {
            "type": "enum",
            "help": "<ps|worker>: This task's job in the cluster.",
            "default": None,
            "choices": ["ps", "worker"],
        },
        "label_smoothing": {
            "type": "float",
            "help": "Label smoothing of the cross-entropy.",
            "default": 0.0,
        },
        "learning_rate": {"type": "float", "help": "Initial learning rate.", "default": 0.05},
        "learning_rate_decay_factor": {
            "type": "float",
            "help": "Exponential decay factor.",
            "default": 0.94,
        },
        "learning_rate_decay_type": {
            "type": "enum",
            "help": "<fixed|exponential|polynomial>: How the learning rate decays.",
            "default": "fixed",
            "choices": ["fixed", "exponential", "polynomial"],
        },
        "log_every_n_steps": {
            "type": "int",
            "help": "Steps between progress lines (0: none).",
            "default": 100,
            "lower": 0,
        },
        "losses_before": {
            "type": "int",
            "help": "Losses of the good steps before a bad step that its record keeps.",
            "default": 50,
        },
        "master": {
            "type": "string",
            "help": "The TensorFlow master ('' runs in-process).",
            "default": "",
        },
        "max_checkpoints_to_keep": {
            "type": "int",
            "help": "Checkpoints kept in "
            "--train_dir (all finite: more "
            "of them give rollback older "
            "points to return to).",
            "default": 5,
            "lower": 1,
        },
        "max_consecutive_bad_steps": {
            "type": "int",
            "help": "Under skip or rollback, "
            "apply "
            "--persistent_nan_policy "
            "after this many bad steps in "
            "a row.",
            "default": 10,
            "lower": 1,
        },
        "max_number_of_steps": {
            "type": "int",
            "help": "Stop when the global step reaches this.",
            "default": 2000,
        },
        "max_rollbacks": {
            "type": "int",
            "help": "Give up (exit 1) rather than roll back more often.",
            "default": 3,
            "lower": 1,
        },
        "model_name": {
            "type": "enum",
            "help": "<mlp|lenet|cifarnet|cifarnet_bn|resnet_v1_50|resnet_v2_50|inception_v1|vgg_a|alexnet_v2>: "
            "The model to train.",
            "default": "mlp",
            "choices": [
                "mlp",
                "lenet",
                "cifarnet",
                "cifarnet_bn",
                "resnet_v1_50",
                "resnet_v2_50",
                "inception_v1",
                "vgg_a",
                "alexnet_v2",
            ],
        },
        "momentum": {
            "type": "float",
            "help": "Momentum of the momentum optimizer.",
            "default": 0.9,
        },
        "nan_policy": {
            "type": "enum",
            "help": "<raise|stop|skip|rollback|auto>: What a bad "
            "step (NaN/Inf loss or gradient) does: raise "
            "(exit 1), stop (clean stop, exit 3), skip "
            "(next batch), rollback (latest good "
            "checkpoint), auto (the autopsy's triage "
            "decides: skip a transient or a bad example, "
            "roll back a broken state).",
            "default": "skip",
            "choices": ["raise", "stop", "skip", "rollback", "auto"],
        },
        "num_epochs_per_decay": {
            "type": "float",
            "help": "Epochs per exponential decay, or "
            "over which polynomial decay "
            "reaches --end_learning_rate.",
            "default": 2.0,
        },
        "opt_epsilon": {
            "type": "float",
            "help": "Epsilon of adam, rmsprop and adadelta.",
            "default": 1.0,
        },
        "optimizer": {
            "type": "enum",
            "help": "<sgd|momentum|rmsprop|adam|adagrad|adadelta|ftrl>: The optimizer.",
            "default": "momentum",
            "choices": ["sgd", "momentum", "rmsprop", "adam", "adagrad", "adadelta", "ftrl"],
        },
        "persistent_nan_policy": {
            "type": "enum",
            "help": "<raise|stop|rollback>: What "
            "--max_consecutive_bad_steps bad "
            "steps in a row (the weights, not "
            "a batch, went bad) do under skip "
            "or rollback: raise (exit 1), "
            "stop (clean stop, exit 3), "
            "rollback (latest good "
            "checkpoint, within "
            "--max_rollbacks); not skip, "
            "which would never end.",
            "default": "raise",
            "choices": ["raise", "stop", "rollback"],
        },
        "ps_hosts": {
            "type": "list",
            "help": "Parameter servers, HOST:PORT comma-separated "
            "(with --worker_hosts, --job_name and --task: "
            "a ps/worker cluster; or TF_CONFIG).",
            "default": [],
        },
        "ps_timeout_secs": {
            "type": "float",
            "help": "How long a worker waits for the ps to "
            "answer at its start; and how long a ps "
            "waits, at the end, for a worker whose "
            "port stopped answering (killed) before "
            "exiting 1 naming it.",
            "default": 60.0,
            "lower": 0.0,
        },
        "reasons": {
            "type": "list",
            "help": "More reasons to reject a step, comma-separated "
            "module:name entries: each a "
            "slim_nanguard.Reason object of an importable "
            "module, or a function of none that returns one "
            "(its policy is its own). Judged after NaN/Inf "
            "and --spike_policy.",
            "default": [],
        },
        "replicas_to_aggregate": {
            "type": "int",
            "help": "With --sync_replicas: gradients "
            "per step (default: one per "
            "worker; fewer gives backup "
            "workers).",
            "default": None,
            "lower": 1,
        },
        "rmsprop_decay": {"type": "float", "help": "Decay of rmsprop.", "default": 0.9},
        "rmsprop_momentum": {"type": "float", "help": "Momentum of rmsprop.", "default": 0.9},
        "rollback_lr_factor": {
            "type": "float",
            "help": "Multiply the learning rate by this at each rollback, in (0, 1].",
            "default": 1.0,
        },
        "rollback_skip_batches": {
            "type": "int",
            "help": "Batches skipped after a rollback.",
            "default": 1,
            "lower": 0,
        },
        "save_interval_secs": {
            "type": "int",
            "help": "Seconds between checkpoints.",
            "default": 600,
            "lower": 0,
        },
        "save_interval_steps": {
            "type": "int",
            "help": "Steps between checkpoints; when > 0 it replaces --save_interval_secs.",
            "default": 0,
            "lower": 0,
        },
        "save_summaries_secs": {
            "type": "int",
            "help": "Seconds between summaries (when --save_summaries_steps is 0).",
            "default": 600,
            "lower": 0,
        },
        "save_summaries_steps": {
            "type": "int",
            "help": "Steps between summaries (0: by time).",
            "default": 100,
            "lower": 0,
        },
        "seed": {
            "type": "int",
            "help": "Seed of the graph and of the shuffling (same seed, same run).",
            "default": 0,
        },
        "spike_level_shift_steps": {
            "type": "int",
            "help": "With --spike_policy=skip: this "
            "many spikes in a row that hold "
            "together are a new level of "
            "training, not spikes: the "
            "guard says so, starts its "
            "statistics again from them and "
            "goes on (below "
            "--max_consecutive_bad_steps; "
            "0: never).",
            "default": 8,
            "lower": 0,
        },
        "spike_policy": {
            "type": "enum",
            "help": "<none|raise|stop|skip|rollback|auto>: "
            "What a spike does: a step whose values "
            "are all finite but whose loss or global "
            "gradient norm is more than --spike_sigma "
            "deviations above those of the accepted "
            "steps (it then changes nothing, and "
            "counts as a bad step in a row): raise, "
            "stop, skip, rollback or auto, as "
            "--nan_policy; none (the default): no "
            "spike test.",
            "default": "none",
            "choices": ["none", "raise", "stop", "skip", "rollback", "auto"],
        },
        "spike_sigma": {
            "type": "float",
            "help": "With --spike_policy: how many standard "
            "deviations (of the logarithms, over the "
            "last 128 accepted steps) above their mean "
            "make a spike.",
            "default": 6.0,
        },
        "spike_warmup_steps": {
            "type": "int",
            "help": "With --spike_policy: steps accepted before the first spike test (2 to 128).",
            "default": 20,
            "lower": 2,
            "upper": 128,
        },
        "sync_replicas": {
            "type": "bool",
            "help": "Aggregate the workers' gradients each "
            "step (SyncReplicasOptimizer) instead of "
            "training asynchronously.",
            "default": False,
        },
        "task": {"type": "int", "help": "Task id; task 0 is the chief.", "default": 0, "lower": 0},
        "train_dir": {
            "type": "string",
            "help": "Directory for checkpoints, summaries and the "
            "event record (nanguard_events.jsonl). A "
            "directory with a checkpoint is resumed.",
            "default": None,
            "required": True,
        },
        "train_image_size": {
            "type": "int",
            "help": "Image side fed to the model; default: "
            "the model's own (28 for lenet, 224 "
            "for the tf_slim.nets, the data's for "
            "mlp).",
            "default": None,
            "lower": 1,
        },
        "trainable_scopes": {
            "type": "list",
            "help": "Comma-separated variable scopes to train (default: all).",
            "default": [],
        },
        "weight_decay": {
            "type": "float",
            "help": "L2 coefficient of the model's weights.",
            "default": 4e-05,
        },
        "worker_hosts": {
            "type": "list",
            "help": "Workers, HOST:PORT comma-separated; "
            "worker 0 is the chief (checkpoints, "
            "summaries, evaluation).",
            "default": [],
        },
    },
    "eval": {
        "batch_size": {
            "type": "int",
            "help": "Examples per evaluation batch.",
            "default": 100,
            "lower": 1,
        },
        "checkpoint_path": {
            "type": "string",
            "help": "The checkpoint to evaluate: a file "
            "prefix (model.ckpt-N) or a training "
            "directory (its latest checkpoint).",
            "default": None,
            "required": True,
        },
        "dataset_dir": {
            "type": "string",
            "help": "Directory of the TFRecord files (tfrecord only).",
            "default": None,
        },
        "dataset_name": {
            "type": "enum",
            "help": "<digits|synthetic|tfrecord>: The dataset to evaluate on.",
            "default": "digits",
            "choices": ["digits", "synthetic", "tfrecord"],
        },
        "dataset_split_name": {
            "type": "string",
            "help": "The split to evaluate on.",
            "default": "test",
        },
        "eval_dir": {
            "type": "string",
            "help": "Where to write the evaluation summaries (default: none written).",
            "default": None,
        },
        "eval_image_size": {
            "type": "int",
            "help": "Image side fed to the model (as in training); default: the model's own.",
            "default": None,
            "lower": 1,
        },
        "master": {
            "type": "string",
            "help": "The TensorFlow master ('' runs in-process).",
            "default": "",
        },
        "max_num_batches": {
            "type": "int",
            "help": "Evaluate at most this many batches (default: the whole split).",
            "default": None,
            "lower": 1,
        },
        "model_name": {
            "type": "enum",
            "help": "<mlp|lenet|cifarnet|cifarnet_bn|resnet_v1_50|resnet_v2_50|inception_v1|vgg_a|alexnet_v2>: "
            "The model the checkpoint holds.",
            "default": "mlp",
            "choices": [
                "mlp",
                "lenet",
                "cifarnet",
                "cifarnet_bn",
                "resnet_v1_50",
                "resnet_v2_50",
                "inception_v1",
                "vgg_a",
                "alexnet_v2",
            ],
        },
    },
    "autopsy": {
        "plot": {
            "type": "string",
            "help": "Draw the loss over steps with the bad steps "
            "(spikes apart from NaN/Inf steps), skips and "
            "rollbacks marked, to this .png (needs "
            "matplotlib: the 'plot' extra).",
            "default": None,
        },
        "replay": {
            "type": "bool",
            "help": "Rebuild the graph from the checkpoint's meta "
            "graph and replay the step from its dump (the "
            "kept batch and weights).",
            "default": False,
        },
        "step": {
            "type": "int",
            "help": "The global step of the bad step to show "
            "(default: the latest one with an autopsy).",
            "default": None,
            "lower": 0,
        },
        "timeout_secs": {
            "type": "float",
            "help": "The longest the --replay may take.",
            "default": 60.0,
            "lower": 0.0,
        },
    },
    "benchmark": {
        "bad_step_repeats": {
            "type": "int",
            "help": "Bad steps timed per policy (default 3; quick 1).",
            "default": None,
        },
        "batch_scale": {
            "type": "float",
            "help": "Multiplies every batch size (default 1).",
            "default": None,
        },
        "chunks": {
            "type": "int",
            "help": "Timed chunks per session and round; the fastest counts (default 2).",
            "default": None,
        },
        "deep_layers": {
            "type": "int",
            "help": "Hidden layers of the deep narrow net (default 50).",
            "default": None,
        },
        "fault_modes": {
            "type": "list",
            "help": "The modes for --faults: check_numerics, hook.",
            "default": ["check_numerics"],
        },
        "fault_policies": {
            "type": "list",
            "help": "The nan_policy values for --faults.",
            "default": ["skip", "rollback"],
        },
        "fault_steps": {
            "type": "int",
            "help": "Training steps of each --faults run.",
            "default": 2000,
        },
        "fault_workdir": {
            "type": "string",
            "help": "Where the --faults runs train; default: a temporary directory.",
            "default": None,
        },
        "faults": {
            "type": "bool",
            "help": "Instead of timing, train the default "
            "config's run with a fault of each cause (a "
            "transient NaN, a bad example, a "
            "learning-rate jump, and none) under each of "
            "--fault_policies, and print the test "
            "accuracy, the bad steps and the triage's "
            "verdicts.",
            "default": False,
        },
        "inter_op_threads": {
            "type": "int",
            "help": "Session inter-op threads (0: TensorFlow's).",
            "default": None,
        },
        "intra_op_threads": {
            "type": "int",
            "help": "Session intra-op threads (0: TensorFlow's).",
            "default": None,
        },
        "keep_freed_memory": {
            "type": "bool",
            "help": "Have glibc malloc keep freed "
            "memory (one arena, no trim, no "
            "mmap below 32 MiB) so that no "
            "session page-faults its step's "
            "tensors back in every step; "
            "which sessions did so was down "
            "to allocation history, not to "
            "the variant, and moved their "
            "times by up to 10%.",
            "default": True,
        },
        "markdown": {
            "type": "string",
            "help": "Also write the tables as Markdown to this file.",
            "default": None,
        },
        "memory": {
            "type": "bool",
            "help": "Trace a few steps of each variant for the most bytes its step holds at once.",
            "default": True,
        },
        "models": {
            "type": "list",
            "help": "Models to time (default: mlp,deep, the "
            "targets'): mlp, lenet, deep, wide, "
            "cifarnet, mobilenet.",
            "default": None,
        },
        "optimizers": {
            "type": "list",
            "help": "Optimizers (default: sgd): sgd, adam.",
            "default": None,
        },
        "out": {
            "type": "string",
            "help": "Write the results as JSON to this file.",
            "default": None,
        },
        "profile": {
            "type": "bool",
            "help": "Instead of timing, profile traced steps of "
            "each variant against the unguarded op "
            "(RunMetadata step stats): nodes executed, "
            "op time, and what the guard adds by op "
            "type and name scope. Defaults: "
            "--models=deep --optimizers=sgd and our two "
            "modes (raise); flags given explicitly "
            "still win.",
            "default": False,
        },
        "profile_steps": {
            "type": "int",
            "help": "Traced steps per variant for --profile (averaged).",
            "default": 10,
        },
        "profile_top": {
            "type": "int",
            "help": "Largest groups shown per variant for --profile.",
            "default": 8,
        },
        "quick": {
            "type": "bool",
            "help": "The default models and every variant, SGD "
            "only, one session each, a few short rounds: "
            "a look in under two minutes. Flags given "
            "explicitly still win.",
            "default": False,
        },
        "replicas": {
            "type": "int",
            "help": "Sessions per variant (own variables, own "
            "memory layout); the fastest counts "
            "(default 2; quick 1).",
            "default": None,
        },
        "round_seconds": {
            "type": "float",
            "help": "Time of one variant in one round (default 0.12; quick 0.03).",
            "default": None,
        },
        "rounds": {
            "type": "int",
            "help": "Interleaved rounds (default 7; quick 3).",
            "default": None,
        },
        "seed": {
            "type": "int",
            "help": "Seed of the data, weights and variant order.",
            "default": None,
        },
        "startup": {
            "type": "bool",
            "help": "Instead of timing steps, time what a user "
            "waits for before the first step: building "
            "the train op and the graph, then session, "
            "initializers and first step, guarded (both "
            "modes) against tf-slim's, in fresh graphs. "
            "Default --models=resnet_v1_50,inception_v1 "
            "(the launcher's nets, any of "
            "slim_nanguard.app.models').",
            "default": False,
        },
        "startup_repeats": {
            "type": "int",
            "help": "Repeats per variant for --startup (medians).",
            "default": 3,
        },
        "variants": {
            "type": "list",
            "help": "Variants to time (default: all); the "
            "baselines they are compared with are "
            "added.",
            "default": None,
        },
        "warmup_steps": {
            "type": "int",
            "help": "Untimed steps per session (default 10; quick 5).",
            "default": None,
        },
    },
}
