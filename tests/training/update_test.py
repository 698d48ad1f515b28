"""Phases 3 to 5 (`tf_dpadam.training.update`): noise once, scale, apply."""

from unittest import mock

import keras
import numpy as np
import tensorflow as tf
from absl.testing import absltest

import tf_dpadam
from tf_dpadam.training import hooks as step_hooks
from tf_dpadam.common import seeds
from tf_dpadam.training import noise_history
from tf_dpadam.training import update


def _update(optimizer, variables, hooks=()):
    return update.Update(optimizer, variables, seeds.NoiseSeeds(0),
                         tuple(hooks))


def _sgd(**kwargs):
    # Learning rate 1: the update is the private gradient.
    return tf_dpadam.DPSGD(learning_rate=1.0, l2_norm_clip=1.0, **kwargs)


class UpdateTest(absltest.TestCase):

    def test_without_noise_the_update_is_the_sum_over_b(self):
        variable = keras.Variable(np.zeros(3, "float32"))
        optimizer = _sgd(noise_multiplier=0.0, batch_size=4)
        optimizer.build([variable])
        update.apply_clipped_sum(_update(optimizer, [variable]),
                                 [tf.constant([1.0, 2.0, 4.0])],
                                 tf.constant(3.0))
        # Divided by the public B = 4, not by the count 3.
        np.testing.assert_allclose(variable.numpy(), [-0.25, -0.5, -1.0])
        self.assertEqual(int(optimizer.iterations.numpy()), 1)

    def test_noise_has_the_configured_std(self):
        variable = keras.Variable(np.zeros(20000, "float32"))
        optimizer = _sgd(noise_multiplier=2.0, batch_size=1)
        optimizer.build([variable])
        update.apply_clipped_sum(_update(optimizer, [variable]),
                                 [tf.zeros(20000)], tf.constant(1.0))
        # sigma * C = 2: the sample std of 20,000 draws is within 3%.
        self.assertAlmostEqual(float(np.std(variable.numpy())), 2.0,
                               delta=0.06)

    def test_accumulation_applies_once_per_logical_step(self):
        variable = keras.Variable(np.zeros(2, "float32"))
        optimizer = _sgd(noise_multiplier=0.0, batch_size=None,
                         gradient_accumulation_steps=2)
        optimizer.build([variable])
        step = _update(optimizer, [variable])
        update.apply_clipped_sum(step, [tf.constant([1.0, 0.0])],
                                 tf.constant(1.0))
        np.testing.assert_allclose(variable.numpy(), [0.0, 0.0])
        self.assertEqual(int(optimizer.iterations.numpy()), 0)
        update.apply_clipped_sum(step, [tf.constant([2.0, 3.0])],
                                 tf.constant(2.0))
        # (1 + 2, 0 + 3) / (1 + 2 examples), applied once.
        np.testing.assert_allclose(variable.numpy(), [-1.0, -1.0])
        self.assertEqual(int(optimizer.iterations.numpy()), 1)
        sums, count, unclipped = optimizer.dp_accumulator.totals()
        np.testing.assert_allclose(sums[0].numpy(), [0.0, 0.0])
        self.assertEqual(float(count.numpy()), 0.0)
        self.assertIsNone(unclipped)  # no adaptive clipping

    def test_hooks_add_to_the_sum_before_the_noise(self):

        class AddOne(step_hooks.StepHooks):
            def add_to_sum(self, summed, count, variables, l2_norm_clip,
                           step):
                return [s + 1.0 for s in summed], count + 1.0

        variable = keras.Variable(np.zeros(2, "float32"))
        optimizer = _sgd(noise_multiplier=0.0, batch_size=None)
        optimizer.build([variable])
        update.apply_clipped_sum(_update(optimizer, [variable], [AddOne()]),
                                 [tf.constant([1.0, 3.0])], tf.constant(1.0))
        np.testing.assert_allclose(variable.numpy(), [-1.0, -2.0])

    def test_clip_norm_folds_the_hooks(self):

        class Double(step_hooks.StepHooks):
            def clip_norm(self, l2_norm_clip):
                return 2 * l2_norm_clip

        optimizer = tf_dpadam.DPSGD(l2_norm_clip=1.5, noise_multiplier=1.0)
        self.assertEqual(update.clip_norm(optimizer, ()), 1.5)
        self.assertEqual(update.clip_norm(optimizer, (Double(), Double())),
                         6.0)


class CorrelatedNoiseTest(absltest.TestCase):

    def test_replicas_of_one_worker_take_it_several_workers_not(self):
        optimizer = _sgd(noise_multiplier=1.0, noise_strategy=2)
        step = update.Update(optimizer, [], seeds.NoiseSeeds(0),
                             noise_history=noise_history.NoiseHistory())
        strategy = tf.distribute.MirroredStrategy(["/cpu:0"])
        with strategy.scope():
            self.assertIs(update.CorrelatedNoise.of(step).strategy,
                          optimizer.noise_strategy)
            with mock.patch.object(update.sharding,
                                   "workers_and_local_replicas",
                                   return_value=(2, 1)):
                with self.assertRaisesRegex(
                        ValueError, "noise_strategy with 1 band with"
                        " several tf.distribute workers, got 2 bands"):
                    update.CorrelatedNoise.of(step)


if __name__ == "__main__":
    absltest.main()
