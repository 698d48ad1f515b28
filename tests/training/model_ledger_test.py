"""Tests of the privacy ledger a private model owns (tf_dpadam.training.model_ledger).

The recipes of issue 49 (recompile, refit, load, a user's pipeline, ...)
are in privacy_ledger_recipes_test.py; here: what the train step counts
(accumulation, XLA, several steps per execution), what the stores carry,
the audit's breaks, and `class_weight` under Poisson sampling.
"""

import os
import tempfile

from absl.testing import absltest
from absl.testing import parameterized
import h5py
import keras
import numpy as np
import pytest

import tf_dpadam
from tf_dpadam.tools import audit
from tf_dpadam.training import model_ledger
from tf_dpadam.training import private_fit

N, B, SIGMA, DELTA = 64, 8, 1.0, 1e-5


def _data(n=N):
    rng = np.random.default_rng(0)
    return (rng.normal(size=(n, 3)).astype("float32"),
            rng.integers(0, 2, size=n))


def _model(seed=None, jit_compile=False, steps_per_execution=1, **optimizer):
    keras.utils.set_random_seed(0)
    model = tf_dpadam.make_private(
        keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)]),
        seed=seed)
    model.compile(
        optimizer=tf_dpadam.DPSGD(l2_norm_clip=1.0, noise_multiplier=SIGMA,
                                  batch_size=B, learning_rate=0.1,
                                  **optimizer),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile, steps_per_execution=steps_per_execution)
    return model


class CountingTest(parameterized.TestCase):

    @parameterized.named_parameters(
        ("graph", {}, {}),
        ("xla", dict(jit_compile=True), {}),
        ("steps_per_execution", dict(steps_per_execution=3), {}),
        ("accumulation", {}, dict(gradient_accumulation_steps=2)),
    )
    @pytest.mark.slow
    def test_counts_each_logical_step_once(self, compiled, optimizer):
        model = _model(**compiled, **optimizer)
        x, y = _data()
        k = optimizer.get("gradient_accumulation_steps", 1)
        model.fit(x, y, epochs=1, steps_per_epoch=6 * k, verbose=0)
        iterations = int(model.optimizer.iterations.numpy())
        self.assertEqual(iterations, 6)
        self.assertEqual(model.privacy_ledger.steps, 6)
        segment, = model.privacy_ledger.segments
        self.assertEqual(segment.mechanism.sampling, "poisson")
        self.assertEqual(segment.mechanism.accumulation_steps, k)
        self.assertEqual(model.spent_epsilon(DELTA),
                         tf_dpadam.epsilon_after_steps(
                             steps=6, num_examples=N, batch_size=B,
                             noise_multiplier=SIGMA, delta=DELTA,
                             accountant="pld"))

    @pytest.mark.slow
    def test_train_on_batch_is_any_batch(self):
        model = _model()
        x, y = _data()
        for _ in range(3):
            model.train_on_batch(x[:B], y[:B])
        segment, = model.privacy_ledger.segments
        self.assertEqual((segment.mechanism.sampling, segment.steps),
                         ("every_step", 3))

    @pytest.mark.slow
    def test_each_fit_opens_a_segment(self):
        model = _model()
        x, y = _data()
        model.fit(x, y, epochs=1, steps_per_epoch=2, verbose=0)
        model.fit(x, y, epochs=1, steps_per_epoch=3, verbose=0)
        self.assertEqual([s.steps for s in model.privacy_ledger.segments],
                         [2, 3])

    @pytest.mark.slow
    def test_wrapping_the_same_model_again_keeps_the_ledger(self):
        # Its weights carry what the first wrapper spent.
        model = _model()
        x, y = _data()
        model.fit(x, y, epochs=1, steps_per_epoch=3, verbose=0)
        again = tf_dpadam.make_private(model.base_model)
        self.assertEqual(again.privacy_ledger, model.privacy_ledger)
        self.assertEqual(again.privacy_ledger.steps, 3)

    @pytest.mark.slow
    def test_a_broken_privatizer_is_recorded_without_noise(self):
        model = _model()
        x, y = _data()
        model.fit(x, y, epochs=1, steps_per_epoch=2, verbose=0)
        self.assertLess(model.spent_epsilon(DELTA), float("inf"))
        with self.assertWarns(UserWarning):
            audit.break_privatizer(model, "no_noise")
        model.fit(x, y, epochs=1, steps_per_epoch=1, verbose=0)
        self.assertEqual(model.privacy_ledger.segments[-1].mechanism
                         .noise_multiplier, 0.0)
        self.assertEqual(model.spent_epsilon(DELTA), float("inf"))


class StoresTest(absltest.TestCase):

    @pytest.mark.slow
    def test_get_config_and_from_config_carry_it(self):
        model = _model()
        x, y = _data()
        model.fit(x, y, epochs=1, steps_per_epoch=4, verbose=0)
        config = model.get_config()
        self.assertEqual(config["privacy_ledger"],
                         model.privacy_ledger.to_json())
        again = type(model).from_config(config)
        self.assertEqual(again.privacy_ledger, model.privacy_ledger)

    @pytest.mark.slow
    def test_loading_an_earlier_file_never_lowers_it(self):
        model = _model()
        x, y = _data()
        model.fit(x, y, epochs=1, steps_per_epoch=2, verbose=0)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "early.weights.h5")
            model.save_weights(path)
            model.fit(x, y, epochs=1, steps_per_epoch=3, verbose=0)
            spent = model.spent_epsilon(DELTA)
            model.load_weights(path)
        self.assertEqual(model.privacy_ledger.steps, 5)
        self.assertEqual(model.spent_epsilon(DELTA), spent)

    @pytest.mark.slow
    def test_a_store_without_a_ledger_is_flagged(self):
        model = _model()
        x, y = _data()
        model.fit(x, y, epochs=1, steps_per_epoch=2, verbose=0)
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "old.weights.h5")
            model.save_weights(path)
            with h5py.File(path, "a") as f:
                found = []
                f.visit(lambda name: found.append(name)
                        if name.endswith(model_ledger.STORE_KEY) else None)
                self.assertLen(found, 1)
                del f[found[0]]
            fresh = _model()
            self.assertFalse(fresh._model_ledger.loaded_without_ledger)
            fresh.load_weights(path)
        self.assertTrue(fresh._model_ledger.loaded_without_ledger)
        self.assertEqual(fresh.privacy_ledger.steps, 0)


class ClassWeightTest(absltest.TestCase):

    def test_folded_like_keras(self):
        y = np.array([0, 1, 2, 1])
        np.testing.assert_array_equal(
            private_fit.class_weighted(y, None, {0: 1.0, 1: 2.0, 2: 0.5}),
            [1.0, 2.0, 0.5, 2.0])
        one_hot = np.eye(3)[y]
        np.testing.assert_array_equal(
            private_fit.class_weighted(one_hot, np.array([1, 1, 2, 2]),
                                       {0: 1.0, 1: 2.0, 2: 0.5}),
            [1.0, 2.0, 1.0, 4.0])
        with self.assertRaisesRegex(ValueError, r"class_weight.*\[2\]"):
            private_fit.class_weighted(y, None, {0: 1.0, 1: 2.0})

    @pytest.mark.slow
    def test_poisson_fit_equals_the_same_sample_weights(self):
        x, y = _data()
        weights = {0: 0.5, 1: 3.0}
        with self.assertWarns(UserWarning):  # The explicit seed's warning.
            by_class = _model(seed=3)
        by_class.fit(x, y, epochs=1, steps_per_epoch=4, verbose=0,
                     class_weight=weights)
        with self.assertWarns(UserWarning):
            by_example = _model(seed=3)
        by_example.fit(x, y, epochs=1, steps_per_epoch=4, verbose=0,
                       sample_weight=np.where(y == 1, 3.0, 0.5))
        for a, b in zip(by_class.get_weights(), by_example.get_weights()):
            np.testing.assert_array_equal(a, b)
        self.assertEqual(by_class.privacy_ledger.steps, 4)

    def test_refused_in_our_words_on_a_poisson_pipeline(self):
        x, y = _data()
        batches = tf_dpadam.data.poisson_batches((x, y), expected_batch_size=B)
        with self.assertRaisesRegex(ValueError, "class_weight=None"):
            _model().fit(batches.dataset, class_weight={0: 1.0, 1: 2.0},
                         verbose=0)


if __name__ == "__main__":
    absltest.main()
