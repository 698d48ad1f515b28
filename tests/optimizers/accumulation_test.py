"""Logical vs physical batches: gradient accumulation (accumulation.py).

Poisson-sampled batches (src/tf_dpadam/data/__init__.py) are tested in data_test.py.
"""

import math
import os
import tempfile

import keras
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized

import tf_dpadam

import helpers


def _mlp(seed=0, d=5, regularized=False):
    """A d -> 7 (tanh) -> 3 MLP, optionally L2-regularized."""
    regularizer = keras.regularizers.L2(0.05) if regularized else None
    return helpers.mlp(d=d, hidden=7, seed=seed,
                       kernel_regularizer=regularizer)


_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def _optimizer(name, **kwargs):
    if name == "dpsgd":
        return tf_dpadam.DPSGD(learning_rate=0.1, momentum=0.5, **kwargs)
    if name == "dpadam":
        return tf_dpadam.DPAdam(learning_rate=0.01, **kwargs)
    return tf_dpadam.DPAdamCorrected(
        learning_rate=0.01, phi=1e-4, epsilon=1e-6, **kwargs
    )


def _zero_gradient_model(units):
    # Zero inputs and zero targets: every example's gradient is exactly 0, so
    # the applied gradient is the noise alone.
    model = keras.Sequential([
        keras.Input((units,)),
        keras.layers.Dense(units, use_bias=False, kernel_initializer="zeros"),
    ])
    return model


class AccumulationTest(parameterized.TestCase):

    @parameterized.product(
        optimizer=["dpsgd", "dpadam", "dpadam_corrected"],
        batch_size=[None, 24],
    )
    @pytest.mark.slow
    def test_k_micro_batches_equal_one_logical_batch(self, optimizer,
                                                     batch_size):
        x, y = helpers.classification_data(48, d=5)
        results = []
        for physical, k in ((24, None), (6, 4)):
            model = tf_dpadam.make_private(_mlp(seed=1))
            model.compile(
                optimizer=_optimizer(
                    optimizer, l2_norm_clip=0.2, noise_multiplier=0.0,
                    batch_size=batch_size, gradient_accumulation_steps=k,
                ),
                loss=_LOSS,
            )
            model.fit(x, y, batch_size=physical, epochs=2, shuffle=False,
                      verbose=0, sampling="shuffled")
            # The optimizer advances once per logical step.
            self.assertEqual(int(model.optimizer.iterations), 4)
            results.append(helpers.numpy_values(model.weights))
        for one, accumulated in zip(*results):
            np.testing.assert_allclose(one, accumulated, rtol=1e-5, atol=1e-6)

    @pytest.mark.slow
    def test_resume_in_the_middle_of_a_logical_step(self):
        x, y = helpers.classification_data(36, d=5)

        def build():
            model = tf_dpadam.make_private(_mlp(seed=2))
            model.compile(
                optimizer=_optimizer(
                    "dpadam_corrected", l2_norm_clip=0.2, noise_multiplier=0.0,
                    batch_size=12, gradient_accumulation_steps=3,
                ),
                loss=_LOSS,
            )
            return model

        straight = build()
        straight.fit(x, y, batch_size=4, epochs=1, shuffle=False, verbose=0,
                     sampling="shuffled")

        interrupted = build()
        # Five micro-batches: one logical step and two thirds of the next.
        interrupted.fit(x[:20], y[:20], batch_size=4, shuffle=False,
                        verbose=0, sampling="shuffled")
        self.assertEqual(int(interrupted.optimizer.iterations), 1)
        path = os.path.join(tempfile.mkdtemp(), "mid_step.keras")
        interrupted.save(path)
        resumed = keras.models.load_model(path)
        resumed.fit(x[20:], y[20:], batch_size=4, shuffle=False, verbose=0,
                    sampling="shuffled")
        self.assertEqual(int(resumed.optimizer.iterations), 3)
        for a, b in zip(helpers.numpy_values(straight.weights), helpers.numpy_values(resumed.weights)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    @parameterized.named_parameters(("fixed_b", 64), ("counted_b", None))
    def test_noise_std_is_sigma_c_over_logical_b(self, batch_size):
        units, sigma, clip, k, physical = 320, 1.3, 0.5, 4, 16
        model = tf_dpadam.make_private(_zero_gradient_model(units), seed=3)
        model.compile(
            optimizer=tf_dpadam.DPSGD(
                l2_norm_clip=clip, noise_multiplier=sigma, learning_rate=1.0,
                batch_size=batch_size, gradient_accumulation_steps=k,
            ),
            loss="mse",
        )
        x = np.zeros((k * physical, units), "float32")
        model.fit(x, x, batch_size=physical, shuffle=False, verbose=0,
                  sampling="shuffled")
        self.assertEqual(int(model.optimizer.iterations), 1)
        update = -np.array(model.base_model.weights[0]).ravel()
        logical_b = k * physical
        expected = sigma * clip / logical_b
        # n = 102,400 coordinates: the sample std has relative standard error
        # 1/sqrt(2n) = 0.22%; 1.5% is about 7 standard errors. Noise added on
        # every micro-batch would give sqrt(k) = 2x, caught by a wide margin.
        self.assertAlmostEqual(np.std(update) / expected, 1.0, delta=0.015)
        self.assertLess(abs(np.mean(update)), 5 * expected / math.sqrt(update.size))
        # Phi of DPAdamCorrected is computed from that same B.
        phi = float(model.optimizer.noise_phi())
        self.assertAlmostEqual(phi / expected**2, 1.0, places=5)


if __name__ == "__main__":
    absltest.main()
