"""Fixtures of the research harness's tests (research/tests).

Recorded runs (research/tests/testdata), small training configurations,
training functions that write a finished run's metrics without training,
and a tiny SST-2-like TSV folder. The library's own fixtures are in
tests/helpers.py.
"""

import dataclasses
import os
import shutil
import tempfile

import numpy as np

from research import common
from research import experiments
from research import runs

TESTDATA = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                        "testdata")
# The grids of the recorded runs in testdata/runs_fashion_mnist.
RECORDED_GRIDS = {"dpsgd": (0.1, 1.0), "dpadam": (1e-3, 1e-2),
                  "dpadam_corrected": (1e-3, 1e-2)}
RECORDED_GAMMAS = {"dpadam": (1e-8,), "dpadam_corrected": (None,)}


def train_config(**overrides):
    """A small `TrainConfig` (B = 16 in physical batches of 8, lr 1e-3,
    evaluated every 2 steps); `overrides` replace its values."""
    values = dict(
        optimizer="dpadam_corrected", l2_norm_clip=1.0, noise_multiplier=1.0,
        batch_size=16, physical_batch_size=8, learning_rate=1e-3,
        epsilon=None, phi=None, beta_1=0.9, beta_2=0.999, momentum=0.0,
        target_epsilon=None, delta=1e-5, epochs=None, eval_every=2,
        model_dir=None, seed=0, jit_compile=False,
    )
    values.update(overrides)
    return common.TrainConfig(**values)


def fake_train_fn(accuracy, calls=None, validation=None):
    """A train_fn that writes the metrics.json of a finished 4-step run
    (evaluated at steps 2 and 4) with `accuracy(config)` on the test set
    and, if given, `validation(config)` (None: none) on the held-out
    examples, without training."""
    def train_fn(config):
        if calls is not None:
            calls.append(config)
        value = accuracy(config)
        held_out = None if validation is None else validation(config)
        results = {
            "config": dataclasses.asdict(config), "num_examples": 64,
            "steps": 4, "planned_steps": 4, "epsilon": 4.87, "delta": 1e-5,
            "test_accuracy": value, "test_loss": 1.0, "wall_seconds": 0.1,
            "history": [{"step": 2, "val_accuracy": value / 2},
                        {"step": 4, "val_accuracy": value}],
        }
        if held_out is not None:
            results.update(validation_accuracy=held_out,
                           validation_loss=1.0)
        os.makedirs(config.model_dir, exist_ok=True)
        # Whole or not at all, as training writes it.
        runs.write_json(os.path.join(config.model_dir, "metrics.json"),
                        results)
        return results
    return train_fn


def tiny_images(num_train=64, num_test=32):
    """8x8 images whose brightness gives the class, as
    `datasets.load_image_dataset` returns them."""
    rng = np.random.default_rng(0)
    splits = []
    for n in (num_train, num_test):
        y = rng.integers(0, 10, n).astype(np.int32)
        x = (y[:, None, None, None] * 0.1
             + rng.random((n, 8, 8, 1)) * 0.05).astype(np.float32)
        splits.append((x, y))
    return tuple(splits)


def copy_testdata(name):
    """A scratch copy of research/tests/testdata/<name> (a folder of run
    folders)."""
    target = os.path.join(tempfile.mkdtemp(), name)
    shutil.copytree(os.path.join(TESTDATA, name), target)
    return target


def recorded_plan(runs_dir):
    """The plan of the recorded runs in
    research/tests/testdata/runs_fashion_mnist: 64 examples, B = 16, one
    epoch (4 steps), 2 x 3 settings, seeds 0, 1."""
    base = common.base_config(
        "fashion_mnist", batch_size=16, noise_multiplier=1.0,
        target_epsilon=None, epochs=1.0, eval_every=2)
    return experiments.make_plan(
        "fashion_mnist", base=base, learning_rates=RECORDED_GRIDS,
        gammas=RECORDED_GAMMAS,
        seeds=(0, 1), runs_dir=runs_dir,
        data=experiments.data_spec("fashion_mnist"))


def write_sst2_tsv(train=48, dev=16):
    """A folder of SST-2-like train.tsv and dev.tsv (random 5-word
    sentences of a tiny vocabulary, label 1 when "good" is in it)."""
    folder = tempfile.mkdtemp()
    generator = np.random.default_rng(0)
    words = ["good", "bad", "movie", "the", "a", "great", "awful"]
    for name, n in (("train.tsv", train), ("dev.tsv", dev)):
        with open(os.path.join(folder, name), "w") as f:
            f.write("sentence\tlabel\n")
            for _ in range(n):
                sentence = " ".join(generator.choice(words, size=5))
                f.write(f"{sentence}\t{int('good' in sentence)}\n")
    return folder
