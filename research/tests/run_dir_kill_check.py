"""One process of run_dir_kill_test.py: research.training in a model_dir.

    python run_dir_kill_check.py MODEL_DIR LOG

Trains a tiny private model (`research.training.fit_private`, Poisson
batches, a checkpoint after every step) for `TOTAL_STEPS` steps in
MODEL_DIR, resuming what is there, and is meant to be SIGKILLed at random
moments by the test. Appends to LOG (one line each, flushed):
`START <step>` when training begins (the step it resumes from) and
`SAVED <step>` when a checkpoint of `<step>` steps is in place.

Each checkpoint write is slowed where a kill hurts most: the temporary file
first holds only the first half of the saved bytes for `HALF_WRITTEN_SECONDS`
(what a kill in the middle of `model.save` leaves), then the whole file, and
only then is it renamed over the checkpoint.
"""

import sys
import time

import keras
import numpy as np

from research import training
from research.tests import research_helpers
from tf_dpadam import run_dir

TOTAL_STEPS = 40
NUM_EXAMPLES = 64
HALF_WRITTEN_SECONDS = 0.15
CONFIG = dict(optimizer="dpadam_corrected", l2_norm_clip=1.0,
              noise_multiplier=1.0, batch_size=16, physical_batch_size=8,
              delta=1e-5, eval_every=1,
              epochs=TOTAL_STEPS * 16 / NUM_EXAMPLES)


def _log(path, line):
    with open(path, "a") as f:
        f.write(line + "\n")
        f.flush()


def _slow_write(write):
    def slow(model, path):
        write(model, path)
        with open(path, "rb") as f:
            whole = f.read()
        with open(path, "wb") as f:
            f.write(whole[:len(whole) // 2])
        time.sleep(HALF_WRITTEN_SECONDS)
        with open(path, "wb") as f:
            f.write(whole)
    return slow


class _Started(keras.callbacks.Callback):

    def __init__(self, log):
        super().__init__()
        self.log = log
        self.started = False

    def on_train_begin(self, logs=None):
        if not self.started:
            self.started = True
            _log(self.log, f"START {int(self.model.optimizer.iterations)}")


def main(model_dir, log):
    save = run_dir.save_checkpoint

    def save_and_log(model, folder):
        save(model, folder)
        _log(log, f"SAVED {int(model.optimizer.iterations)}")

    run_dir.write_model = _slow_write(run_dir.write_model)
    run_dir.save_checkpoint = save_and_log
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_EXAMPLES, 3)).astype("float32")
    y = rng.integers(0, 2, size=NUM_EXAMPLES)
    training.fit_private(
        lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]),
        (x, y), (x[:8], y[:8]),
        research_helpers.train_config(model_dir=model_dir, **CONFIG),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        callbacks=[_Started(log)], validate=False, verbose=0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
