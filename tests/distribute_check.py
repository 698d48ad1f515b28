"""Runs in its own process: R logical CPU devices under MirroredStrategy.

Logical devices must be configured before TensorFlow initializes, which the
other tests in the pytest process have already done; `distribute_test.py`
runs this script and reads the JSON it prints.
"""

import json
import sys

import tensorflow as tf

_REPLICAS = int(sys.argv[1]) if len(sys.argv) > 1 else 2
tf.config.set_logical_device_configuration(
    tf.config.list_physical_devices("CPU")[0],
    [tf.config.LogicalDeviceConfiguration()] * _REPLICAS,
)

import keras  # noqa: E402
import numpy as np  # noqa: E402

import tf_dpadam  # noqa: E402


_STRATEGIES = {}


def _strategy(replicas):
    # One MirroredStrategy per process: a second one would reuse the
    # collective instance keys of the first.
    if replicas == 1:
        return tf.distribute.get_strategy()
    if replicas not in _STRATEGIES:
        _STRATEGIES[replicas] = tf.distribute.MirroredStrategy(
            [f"/cpu:{i}" for i in range(replicas)]
        )
    return _STRATEGIES[replicas]


def _views(x, augmult):
    """View r mod K of each row: rows of one example are consecutive, so
    the view index does not depend on how the batch is split."""
    k = tf.cast(tf.range(tf.shape(x)[0]) % augmult, x.dtype)[:, None]
    return tf.tanh(x * (1.0 + 0.5 * k)) + 0.3 * k


def noise_free_weights(replicas, batch_size, unclipped_sgd=False,
                       accumulation_steps=None, weight_decay=None,
                       augmult=1, adaptive=False, guard=False):
    """Weights after 2 epochs of 2 logical steps of 16 examples each.

    With `accumulation_steps=k` a logical step is k physical batches of
    16 / k examples (16 / (k R) per replica); with `augmult=K` each example
    is K views (`_views`). With `guard` the independence guard checks the
    first batch (`make_private(check_independence=True)`).
    """
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 6)).astype("float32")
    y = rng.integers(0, 3, 32)
    with _strategy(replicas).scope():
        keras.utils.set_random_seed(1)
        base = keras.Sequential([
            keras.Input((6,)),
            keras.layers.Dense(8, activation="tanh"),
            keras.layers.Dense(3),
        ])
        augment = None
        if augmult > 1:
            augment = lambda x: _views(x, augmult)  # noqa: E731
        model = tf_dpadam.make_private(base, seed=2, augment=augment,
                                       augmult=augmult,
                                       check_independence=guard)
        if adaptive:
            # Per-layer adaptive clipping without noise: each layer's C
            # moves by its count of unclipped examples, summed over the
            # replicas (and micro-batches) once per logical step.
            optimizer = tf_dpadam.DPAdamCorrected(
                l2_norm_clip=0.3, noise_multiplier=0.0, phi=1e-4,
                epsilon=1e-6, learning_rate=0.01, batch_size=batch_size,
                per_layer_clipping=True, target_unclipped_quantile=0.7,
                clipped_count_stddev=0.0, clip_learning_rate=0.5,
                gradient_accumulation_steps=accumulation_steps,
            )
        elif unclipped_sgd:
            # No example reaches C and the update is linear in the gradient:
            # per-example gradients off by any factor change the weights.
            optimizer = tf_dpadam.DPSGD(
                l2_norm_clip=1e3, noise_multiplier=0.0, learning_rate=0.1,
                batch_size=batch_size, momentum=0.5,
                weight_decay=weight_decay,
                gradient_accumulation_steps=accumulation_steps,
            )
        else:
            optimizer = tf_dpadam.DPAdamCorrected(
                l2_norm_clip=0.3, noise_multiplier=0.0, phi=1e-4,
                epsilon=1e-6, learning_rate=0.01, batch_size=batch_size,
                weight_decay=weight_decay,
                gradient_accumulation_steps=accumulation_steps,
            )
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
    model.fit(x, y, batch_size=16 // (accumulation_steps or 1), epochs=2,
              shuffle=False, verbose=0, sampling="shuffled")
    assert int(model.optimizer.iterations.numpy()) == 4
    # The privacy ledger counts each logical step once, whatever the replicas.
    assert model.privacy_ledger.steps == 4, model.privacy_ledger
    weights = [w.numpy().tolist() for w in base.weights]
    if adaptive:
        weights.append(list(model.optimizer.l2_norm_clip.values()))
    return weights


def _zero_gradient_model(replicas, units, seed, built=True,
                         **optimizer_kwargs):
    """`(private model, its base)`: a units x units kernel of zeros without
    bias, compiled with DPSGD at learning rate 1 and `optimizer_kwargs`;
    on zero inputs its updates are the noise alone. Not `built`: no
    `keras.Input`, `fit` builds it."""
    with _strategy(replicas).scope():
        base = keras.Sequential(
            ([keras.Input((units,))] if built else [])
            + [keras.layers.Dense(units, use_bias=False,
                                  kernel_initializer="zeros")])
        # No guard: with every row zero it could not check a batch.
        model = tf_dpadam.make_private(base, seed=seed,
                                       check_independence=False)
        model.compile(optimizer=tf_dpadam.DPSGD(learning_rate=1.0,
                                                **optimizer_kwargs),
                      loss="mse")
    return model, base


def noise_update(replicas, units, sigma, clip, batch, batch_size,
                 accumulation_steps=None):
    """The update of one logical step on zero gradients: the noise alone."""
    model, base = _zero_gradient_model(
        replicas, units, 3, l2_norm_clip=clip, noise_multiplier=sigma,
        batch_size=batch_size, gradient_accumulation_steps=accumulation_steps)
    x = np.zeros((batch, units), "float32")
    model.fit(x, x, batch_size=batch // (accumulation_steps or 1), verbose=0,
              sampling="shuffled")
    assert int(model.optimizer.iterations.numpy()) == 1
    return {
        "std": float(np.std(-base.weights[0].numpy())),
        "size": int(base.weights[0].numpy().size),
        "phi": float(model.optimizer.noise_phi()),
    }


class _WeightsAfterEachStep(keras.callbacks.Callback):

    def __init__(self, accumulation_steps):
        super().__init__()
        self.k, self.weights = accumulation_steps, []

    def on_train_batch_end(self, batch, logs=None):
        if (batch + 1) % self.k == 0:  # A logical step's last batch.
            self.weights.append(self.model.trainable_variables[0].numpy())


def banded_noise_covariance(replicas, bands, accumulation_steps=1,
                            built=True):
    """Correlated noise (`noise_strategy=bands`) on zero gradients: the
    T x T covariance of the T = 16 steps' noise over its 102,400
    coordinates (each step's noise w_t / (sigma C), unit variance per
    independent draw), for the test to compare with M^-1 M^-T."""
    units, batch, examples = 320, 8, 128
    model, _ = _zero_gradient_model(
        replicas, units, 4, built, l2_norm_clip=1.0, noise_multiplier=1.0,
        batch_size=batch, noise_strategy=bands,
        gradient_accumulation_steps=accumulation_steps)
    x = np.zeros((examples, units), "float32")
    record = _WeightsAfterEachStep(accumulation_steps)
    model.fit(x, x, verbose=0, callbacks=[record])  # Cyclic Poisson.
    assert model.noise_history.draws == examples // batch
    steps = np.stack([np.zeros((units, units))] + record.weights)
    noise = -np.diff(steps.reshape(len(steps), -1), axis=0) * batch
    return {"covariance": (noise @ noise.T / noise.shape[1]).tolist(),
            "size": int(noise.shape[1]),
            "ledger_bands": sorted({s.mechanism.bands
                                    for s in model.privacy_ledger.segments})}


def main():
    # The independence guard (its first check, its own traces: 1-2 s a
    # replicated fit) runs where the replicas change what it checks: the
    # first replica's part of a distributed batch, replayed to the step,
    # with the optimizer's per-example transform (plain, K views, per-layer
    # adaptive). Training must give the single-device weights with it, as
    # without it. On one device the guard is tests/training/independence_
    # guard_test.py's; it reads neither the optimizer's batch_size, nor
    # momentum, weight decay or accumulation, which the other runs vary.
    result = {
        "replicas": _REPLICAS,
        "single": noise_free_weights(1, None),
        "replicated": noise_free_weights(_REPLICAS, None, guard=True),
        "single_fixed_b": noise_free_weights(1, 16),
        "replicated_fixed_b": noise_free_weights(_REPLICAS, 16),
        "single_sgd": noise_free_weights(1, 16, unclipped_sgd=True),
        "replicated_sgd": noise_free_weights(_REPLICAS, 16,
                                             unclipped_sgd=True),
        "noise_counted_b": noise_update(_REPLICAS, 320, 1.3, 0.5, 32, None),
        "noise_fixed_b": noise_update(_REPLICAS, 320, 1.3, 0.5, 32, 40),
        # Accumulation with replicas: k = 2 physical batches of 8 examples
        # (2 per replica), against the same k on one device.
        "single_accumulated": noise_free_weights(
            1, None, accumulation_steps=2, weight_decay=0.1
        ),
        "replicated_accumulated": noise_free_weights(
            _REPLICAS, None, accumulation_steps=2, weight_decay=0.1
        ),
        # Augmentation multiplicity K = 3: 4 examples (12 views) per
        # replica, each example's 3 views one group on its replica.
        "single_augmult": noise_free_weights(1, None, augmult=3),
        "replicated_augmult": noise_free_weights(_REPLICAS, None, augmult=3,
                                                 guard=True),
        "single_adaptive": noise_free_weights(1, 16, adaptive=True),
        "replicated_adaptive": noise_free_weights(_REPLICAS, 16,
                                                  adaptive=True, guard=True),
        "single_adaptive_accumulated": noise_free_weights(
            1, 16, adaptive=True, accumulation_steps=2),
        "replicated_adaptive_accumulated": noise_free_weights(
            _REPLICAS, 16, adaptive=True, accumulation_steps=2),
        "noise_accumulated": noise_update(
            _REPLICAS, 320, 1.3, 0.5, 32, None, accumulation_steps=4
        ),
        # Correlated noise (issue 53): the history read and written once
        # per logical step, on the replicas and with accumulation; the
        # first with a model that fit builds (its history is made after
        # the build, before the step: a replica's step cannot make it).
        "banded": banded_noise_covariance(_REPLICAS, 4, built=False),
        "banded_accumulated": banded_noise_covariance(
            _REPLICAS, 4, accumulation_steps=2),
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
