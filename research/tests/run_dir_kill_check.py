"""One process of run_dir_kill_test.py: research.training in a model_dir.

    python run_dir_kill_check.py MODEL_DIR LOG

Trains a tiny private model (`research.training.fit_private`, Poisson
batches, a checkpoint after every step) for `TOTAL_STEPS` steps of its
privacy ledger in MODEL_DIR, resuming what is there, and is meant to be
SIGKILLed at random moments by the test. Appends to LOG one line each
(flushed), `<pid> <event> <numbers>`, the steps being the model's ledger's:

* `START <steps> <iterations>` when training begins (the ledger's steps,
  those a killed process lost included, and the optimizer's);
* `BEGIN <step>` once the step is reserved in ledger.json, before it runs
  (so a process took at most its last BEGIN's steps);
* `STEP <step>` when the step has run;
* `SAVED <iterations> <steps>` when a checkpoint of the model is in place.

The writes a kill hurts most are slowed: a checkpoint's temporary file, and
ledger.json's, first hold only the first half of their bytes for
`HALF_WRITTEN_SECONDS` (what a kill in the middle of the write leaves), then
the whole file, and only then are renamed over the old one.
"""

import json
import os
import sys
import time

import keras
import numpy as np

from research import training
from research.tests import research_helpers
from tf_dpadam.tools import run_dir

TOTAL_STEPS = 40
NUM_EXAMPLES = 64
HALF_WRITTEN_SECONDS = 0.1
CONFIG = dict(optimizer="dpadam_corrected", l2_norm_clip=1.0,
              noise_multiplier=1.0, batch_size=16, physical_batch_size=8,
              delta=1e-5, eval_every=1,
              epochs=TOTAL_STEPS * 16 / NUM_EXAMPLES)


def _log(path, *fields):
    with open(path, "a") as f:
        f.write(" ".join(map(str, (os.getpid(),) + fields)) + "\n")
        f.flush()


def _half_then_whole(path, whole):
    """Writes half of `whole` to `path`, waits, then all of it."""
    with open(path, "wb") as f:
        f.write(whole[:len(whole) // 2])
    time.sleep(HALF_WRITTEN_SECONDS)
    with open(path, "wb") as f:
        f.write(whole)


def _slow_model_write(write):
    def slow(model, path):
        write(model, path)
        with open(path, "rb") as f:
            whole = f.read()
        _half_then_whole(path, whole)
    return slow


def _slow_json_write(write):
    def slow(path, value):
        if os.path.basename(path) == run_dir.LEDGER:
            _half_then_whole(f"{path}.{os.getpid()}.partial",
                             json.dumps(value).encode())
        write(path, value)
    return slow


def _steps(model):
    return model.privacy_ledger.steps


class _Logged(keras.callbacks.Callback):
    """Logs START and STEP."""

    def __init__(self, log):
        super().__init__()
        self.log = log
        self.step = None

    def on_train_begin(self, logs=None):
        if self.step is None:
            self.step = _steps(self.model)
            _log(self.log, "START", self.step,
                 int(self.model.optimizer.iterations))

    def on_train_batch_end(self, batch, logs=None):
        if _steps(self.model) != self.step:
            self.step = _steps(self.model)
            _log(self.log, "STEP", self.step)


def _log_reservations(log):
    """Makes `AtomicCheckpoint` log BEGIN after it reserves a step."""
    reserve = run_dir.AtomicCheckpoint.on_train_batch_begin
    begun = []

    def reserve_and_log(self, batch, logs=None):
        reserve(self, batch, logs)
        step = _steps(self.model) + 1
        if step not in begun:
            begun.append(step)
            _log(log, "BEGIN", step)

    run_dir.AtomicCheckpoint.on_train_batch_begin = reserve_and_log


def main(model_dir, log):
    save = run_dir.save_checkpoint

    def save_and_log(model, folder):
        save(model, folder)
        _log(log, "SAVED", int(model.optimizer.iterations), _steps(model))

    run_dir.write_model = _slow_model_write(run_dir.write_model)
    run_dir.write_json = _slow_json_write(run_dir.write_json)
    run_dir.save_checkpoint = save_and_log
    _log_reservations(log)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(NUM_EXAMPLES, 3)).astype("float32")
    y = rng.integers(0, 2, size=NUM_EXAMPLES)
    training.fit_private(
        lambda: keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]),
        (x, y), (x[:8], y[:8]),
        research_helpers.train_config(model_dir=model_dir, **CONFIG),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        callbacks=[_Logged(log)], validate=False, verbose=0)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
