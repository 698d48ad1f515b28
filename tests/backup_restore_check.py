"""One process of tests/backup_restore_test.py: DP training under BackupAndRestore.

    python backup_restore_check.py WORK_DIR KILL_AT

Trains a private model (DP-AdamBC, secret noise) for `TOTAL_STEPS` steps with
`keras.callbacks.BackupAndRestore(WORK_DIR/backup, save_freq=SAVE_FREQ)` and
`tf_dpadam.PrivacyBudget`. Every batch of the same epoch holds the same
examples (fixed batches, `fit(..., sampling="shuffled", shuffle=False)`,
accounted without amplification), so a step's update depends only on the
state and the noise.

After every step it writes the state (optimizer iterations, weights, Adam
moments) to WORK_DIR/state_<run>_<iterations>.npz; when training begins it
writes the state it starts from (restored or fresh) as
WORK_DIR/start_<run>.npz. With KILL_AT > 0 the process kills itself with
SIGKILL once the optimizer has taken KILL_AT steps, as a crash would (no
callback, no clean-up). At the end it prints a JSON line `RESULT {...}`.
"""

import json
import os
import signal
import sys

import keras
import numpy as np

import tf_dpadam

TOTAL_STEPS = 10
SAVE_FREQ = 4  # batches between backups
BATCH = 16
BATCHES_PER_EPOCH = 4
NUM_EXAMPLES = BATCH * BATCHES_PER_EPOCH  # N for the accounting
NOISE_MULTIPLIER = 1.0
CLIP = 1.0
DELTA = 1e-5


def state(model):
    optimizer = model.optimizer
    arrays = {"iterations": np.array(int(optimizer.iterations.numpy()))}
    for i, variable in enumerate(model.trainable_variables):
        arrays[f"weight_{i}"] = keras.ops.convert_to_numpy(variable)
        m, v = optimizer.moments(variable)
        arrays[f"m_{i}"] = keras.ops.convert_to_numpy(m)
        arrays[f"v_{i}"] = keras.ops.convert_to_numpy(v)
    return arrays


class Recorder(keras.callbacks.Callback):
    """Writes the state at the start and after every step; kills on cue."""

    def __init__(self, work_dir, run, kill_at):
        super().__init__()
        self.work_dir, self.run, self.kill_at = work_dir, run, kill_at

    def on_train_begin(self, logs=None):
        np.savez(os.path.join(self.work_dir, f"start_{self.run}.npz"),
                 **state(self.model))

    def on_train_batch_end(self, batch, logs=None):
        arrays = state(self.model)
        step = int(arrays["iterations"])
        np.savez(os.path.join(self.work_dir, f"state_{self.run}_{step}.npz"),
                 **arrays)
        if step >= TOTAL_STEPS:
            self.model.stop_training = True
        if self.kill_at and step == self.kill_at:
            os.kill(os.getpid(), signal.SIGKILL)


def main(work_dir, kill_at):
    run = "first" if kill_at else "second"
    keras.utils.set_random_seed(0)  # same data and initialization each run
    rng = np.random.default_rng(0)
    x = np.tile(rng.normal(size=(BATCH, 5)).astype("float32"),
                (BATCHES_PER_EPOCH, 1))
    y = np.tile(rng.integers(0, 3, BATCH), BATCHES_PER_EPOCH)
    model = tf_dpadam.make_private(keras.Sequential([
        keras.Input((5,)), keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(3)]))
    model.compile(
        optimizer=tf_dpadam.DPAdamCorrected(
            l2_norm_clip=CLIP, noise_multiplier=NOISE_MULTIPLIER,
            batch_size=BATCH, learning_rate=1e-2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    budget = tf_dpadam.PrivacyBudget(num_examples=NUM_EXAMPLES, delta=DELTA,
                                     accountant="rdp")
    history = model.fit(
        x, y, batch_size=BATCH, epochs=TOTAL_STEPS, shuffle=False, verbose=0,
        callbacks=[
            keras.callbacks.BackupAndRestore(
                os.path.join(work_dir, "backup"), save_freq=SAVE_FREQ),
            budget,
            Recorder(work_dir, run, kill_at),
        ],
        sampling="shuffled",
    )
    print("RESULT " + json.dumps({
        "iterations": int(model.optimizer.iterations.numpy()),
        "epsilon": budget.epsilon,
        "epochs_run": len(history.history["loss"]),
    }))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
