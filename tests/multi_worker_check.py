"""Runs as one of two workers of a MultiWorkerMirroredStrategy on localhost.

`multi_worker_test.py` starts two of these processes with the same two
ports; each prints one line `RESULT {json}`. argv: the worker's index, then
the two ports. The strategy is created first, before any other TensorFlow
op (collective ops are configured at start-up).
"""

import json
import os
import sys
import time

_WORKER = int(sys.argv[1])
_PORTS = [int(p) for p in sys.argv[2:4]]
os.environ["TF_CONFIG"] = json.dumps({
    "cluster": {"worker": [f"localhost:{p}" for p in _PORTS]},
    "task": {"type": "worker", "index": _WORKER},
})

import tensorflow as tf  # noqa: E402

_STRATEGY = tf.distribute.MultiWorkerMirroredStrategy()

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dpadam  # noqa: E402
from tf_dpadam import sharding  # noqa: E402

_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _scope(distributed):
    return (_STRATEGY if distributed else tf.distribute.get_strategy()).scope()


def _mlp(d=6):
    keras.utils.set_random_seed(1)
    return keras.Sequential([
        keras.Input((d,)),
        keras.layers.Dense(8, activation="tanh"),
        keras.layers.Dense(3),
    ])


def _weights(model):
    return [w.numpy().tolist() for w in model.base_model.weights]


def noise_free_weights(distributed, accumulation_steps=None):
    """4 logical steps of 16 examples (8 per worker) without noise.

    DPAdamCorrected with the counted B (the example count is all-reduced)
    and active clipping; with `accumulation_steps=k`, k physical batches of
    16 / k per logical step.
    """
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = rng.integers(0, 3, 32)
    with _scope(distributed):
        model = tf_dpadam.make_private(_mlp(), seed=2)
        model.compile(
            optimizer=tf_dpadam.DPAdamCorrected(
                l2_norm_clip=0.3, noise_multiplier=0.0, phi=1e-4,
                epsilon=1e-6, learning_rate=0.01,
                gradient_accumulation_steps=accumulation_steps,
            ),
            loss=_LOSS,
        )
    model.fit(x, y, batch_size=16 // (accumulation_steps or 1), epochs=2,
              shuffle=False, verbose=0, sampling="shuffled")
    assert int(model.optimizer.iterations.numpy()) == 4
    return _weights(model)


def noise_update(units=320, sigma=1.3, clip=0.5, batch=32):
    """One step on zero gradients, secret noise keys (one per worker)."""
    with _scope(True):
        base = keras.Sequential([
            keras.Input((units,)),
            keras.layers.Dense(units, use_bias=False,
                               kernel_initializer="zeros"),
        ])
        model = tf_dpadam.make_private(base)  # seed=None: a secret per worker
        model.compile(
            optimizer=tf_dpadam.DPAdamCorrected(
                l2_norm_clip=clip, noise_multiplier=sigma, learning_rate=1.0,
            ),
            loss="mse",
        )
    x = np.zeros((batch, units), "float32")
    model.fit(x, x, batch_size=batch, verbose=0, sampling="shuffled")
    # SGD would make the update the noise itself; with Adam's first step the
    # update is a sign, so read the applied gradient from the first moment.
    m, _ = model.optimizer.moments(base.weights[0])
    update = m.numpy() / (1 - model.optimizer.beta_1)
    return {
        "std": float(np.std(update)),
        "checksum": float(np.sum(base.weights[0].numpy() * np.arange(units))),
        "phi": float(model.optimizer.noise_phi().numpy()),
    }


_N, _B, _B_PHYSICAL, _STEPS, _SIGMA = 200, 20, 24, 3, 1.0


def _sharded_data():
    rng = np.random.default_rng(3)
    return (rng.normal(size=(_N, 6)).astype("float32"),
            rng.integers(0, 3, _N))


def _sharded_model(accumulation_steps):
    model = tf_dpadam.make_private(_mlp(), seed=4)
    model.compile(
        optimizer=tf_dpadam.DPSGD(
            l2_norm_clip=1.0, noise_multiplier=_SIGMA, learning_rate=0.5,
            batch_size=_B, gradient_accumulation_steps=accumulation_steps,
        ),
        loss=_LOSS,
    )
    return model


def sharded_poisson_training():
    """`fit` on per-worker Poisson shards, and the union on one process."""
    x, y = _sharded_data()
    workers, local = sharding.workers_and_local_replicas(_STRATEGY)
    batches = sharding.sharded_poisson_batches(
        (x, y), expected_batch_size=_B, physical_batch_size=_B_PHYSICAL,
        num_workers=workers, replicas_per_worker=local, seed=5,
        steps_per_epoch=_STEPS,
    )
    with _scope(True):
        model = _sharded_model(batches.accumulation_steps)
    budget = tf_dpadam.PrivacyBudget(num_examples=batches.num_examples,
                                     delta=1e-5, accountant="rdp")
    model.fit(_STRATEGY.distribute_datasets_from_function(batches.dataset_fn),
              steps_per_epoch=batches.micro_steps_per_epoch, epochs=1,
              callbacks=[budget], verbose=0)

    # The same steps on one process: each step's union of the workers'
    # samples as one batch, the same noise seed.
    datasets = [
        batches.dataset_fn(tf.distribute.InputContext(workers, w,
                                                      workers * local))
        for w in range(workers)
    ]
    # Keras iterates the distributed dataset once for the shapes (one
    # batch), then anew for training; every iteration draws new batches.
    for dataset in datasets:
        iter(dataset)
    streams = [iter(dataset) for dataset in datasets]
    reference = _sharded_model(None)
    sizes = []
    for _ in range(_STEPS):
        rows = []
        for stream in streams:
            for _ in range(batches.accumulation_steps * local):
                bx, by, bw = (t.numpy() for t in next(stream))
                rows += [(a, b) for a, b, w in zip(bx, by, bw) if w > 0]
        sizes.append(len(rows))
        reference.train_on_batch(np.stack([r[0] for r in rows]),
                                 np.array([r[1] for r in rows]))
    return {
        "workers": workers,
        "accumulation_steps": batches.accumulation_steps,
        "iterations": int(model.optimizer.iterations.numpy()),
        "steps": _STEPS,
        "epsilon": budget.epsilon,
        "expected_epsilon": tf_dpadam.accounting.epsilon_after_steps(
            steps=_STEPS, num_examples=_N, batch_size=_B,
            noise_multiplier=_SIGMA, delta=1e-5,
        ),
        "sizes": sizes,
        "distributed": _weights(model),
        "single": _weights(reference),
    }


def main():
    result = {"worker": _WORKER, "replicas": _STRATEGY.num_replicas_in_sync}
    parts = {
        "single": lambda: noise_free_weights(False),
        "distributed": lambda: noise_free_weights(True),
        "noise": noise_update,
        "sharded": sharded_poisson_training,
    }
    seconds = {}
    for name, part in parts.items():
        start = time.perf_counter()
        result[name] = part()
        seconds[name] = round(time.perf_counter() - start, 1)
    result["seconds"] = seconds
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
