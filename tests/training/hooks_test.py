"""`StepHooks`: what the train step shows and asks a registered hook."""

import pytest
import keras
import numpy as np
import tensorflow as tf
from absl.testing import absltest

import tf_dpadam
from tf_dpadam.training import hooks as step_hooks

import helpers

_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class RecordingHooks(step_hooks.StepHooks):
    """Keeps the step's clipped sum, B and private gradient in variables."""

    observes_clean_sum = True

    def __init__(self):
        self.calls = []
        self.clean = None
        self.private = None
        self.denominator = None

    def build(self, variables):
        self.calls.append("build")
        if self.clean is None:
            self.clean = [tf.Variable(tf.zeros(v.shape)) for v in variables]
            self.private = [tf.Variable(tf.zeros(v.shape))
                            for v in variables]
            self.denominator = tf.Variable(0.0)

    def clip_norm(self, l2_norm_clip):
        self.calls.append("clip_norm")
        return l2_norm_clip

    def after_clipping(self, norms, losses, present):
        self.calls.append("after_clipping")

    def add_to_sum(self, summed, count, variables, l2_norm_clip, step):
        self.calls.append("add_to_sum")
        return summed, count

    def before_noise(self, summed, denominator):
        self.calls.append("before_noise")
        for variable, value in zip(self.clean, summed):
            variable.assign(value)
        self.denominator.assign(tf.cast(denominator, tf.float32))

    def noise_stddev(self, stddev):
        self.calls.append("noise_stddev")
        return stddev

    def after_noise(self, private_grads, variables):
        self.calls.append("after_noise")
        for variable, value in zip(self.private, private_grads):
            variable.assign(value)


def _private_model(noise_multiplier, seed=0):
    model = tf_dpadam.make_private(helpers.mlp(seed=seed), seed=seed)
    model.compile(
        optimizer=tf_dpadam.DPSGD(
            learning_rate=1.0, l2_norm_clip=0.5,
            noise_multiplier=noise_multiplier, batch_size=None),
        loss=_LOSS)
    return model


class StepHooksTest(absltest.TestCase):

    @pytest.mark.slow
    def test_hooks_see_the_phases_in_order(self):
        model = _private_model(noise_multiplier=1.0)
        hooks = RecordingHooks()
        model.add_step_hooks(hooks)
        self.assertEqual(model.step_hooks, (hooks,))
        x, y = helpers.classification_data(8)
        before = helpers.numpy_values(model.trainable_variables)
        model.train_on_batch(x, y)
        after = helpers.numpy_values(model.trainable_variables)
        # One trace (the last one, if tf.function traced twice).
        self.assertEqual(hooks.calls[-8:], [
            "build", "clip_norm", "after_clipping", "clip_norm",
            "add_to_sum", "before_noise", "noise_stddev", "after_noise"])
        self.assertEqual(float(hooks.denominator.numpy()), 8.0)
        # SGD with learning rate 1: the update is the private gradient.
        for b, a, g in zip(before, after, hooks.private):
            np.testing.assert_allclose(b - a, g.numpy(), atol=1e-6)
        # The clean sum is not the private one: noise was added.
        self.assertFalse(all(
            np.allclose(c.numpy() / 8.0, g.numpy())
            for c, g in zip(hooks.clean, hooks.private)))

    @pytest.mark.slow
    def test_a_hook_can_change_the_noise(self):
        model = _private_model(noise_multiplier=1.0)

        class NoNoise(RecordingHooks):
            def noise_stddev(self, stddev):
                return 0.0

        hooks = NoNoise()
        model.add_step_hooks(hooks)
        x, y = helpers.classification_data(8)
        model.train_on_batch(x, y)
        for clean, private in zip(hooks.clean, hooks.private):
            np.testing.assert_allclose(clean.numpy() / 8.0, private.numpy(),
                                       rtol=1e-6, atol=1e-7)

    def test_registration_is_checked(self):
        model = _private_model(noise_multiplier=1.0)
        with self.assertRaisesRegex(ValueError, "hooks="):
            model.add_step_hooks(object())
        hooks = step_hooks.StepHooks()
        model.add_step_hooks(hooks)
        with self.assertRaisesRegex(ValueError, "not registered yet"):
            model.add_step_hooks(hooks)

    def test_diagnostics_are_a_step_hook(self):
        model = tf_dpadam.make_private(helpers.mlp(), diagnostics=True)
        self.assertLen(model.step_hooks, 1)
        self.assertTrue(model.step_hooks[0].observes_clean_sum)


if __name__ == "__main__":
    absltest.main()
