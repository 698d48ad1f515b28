"""A user's layer with a user's ghost rule, through
`tf_dpadam.register_ghost_rule`, against one-example tapes."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl.testing import absltest
from absl.testing import parameterized
from keras import ops

import tf_dpadam
from tf_dpadam.privatizer import ghost_clipping
from tf_dpadam.privatizer.ghost_clipping import blocks
from tf_dpadam.privatizer.ghost_clipping import dense
from tf_dpadam.privatizer.ghost_clipping import registry
from tf_dpadam.privatizer.ghost_clipping import rule

import helpers


class ScaledDense(keras.layers.Layer):
    """`dropout(x) @ kernel * scale + bias`, over the last axis."""

    def __init__(self, units, dropout=0.0, **kwargs):
        super().__init__(**kwargs)
        self.units = units
        self.dropout = keras.layers.Dropout(dropout)

    def build(self, input_shape):
        self.kernel = self.add_weight(
            shape=(input_shape[-1], self.units), name="kernel")
        self.scale = self.add_weight(
            shape=(self.units,), initializer="random_normal", name="scale")
        self.bias = self.add_weight(
            shape=(self.units,), initializer="random_normal", name="bias")

    def call(self, inputs, training=None):
        x = self.dropout(inputs, training=training)
        return ops.matmul(x, self.kernel) * self.scale + self.bias


class ScaledDenseRule(rule.Rule):
    """u = a W (a the dropped input), z = u * s + b: example i's gradients
    are sum_t a_t^T (g_t * s) for W (the gradient at u), sum_t u_t * g_t
    for s and sum_t g_t for b (g the gradient at z)."""

    name = "ScaledDense"
    weight_names = ("kernel", "scale", "bias")
    shifted_pass = True  # blocks from the records alone

    def intercept(self, recording, original, *args, **kwargs):
        layer = self.layer
        a = layer.dropout(rule.first_input(args, kwargs),
                          training=kwargs.get("training"))
        u = ops.matmul(a, rule.stopped(layer.kernel))
        recording.tape.watch(u)
        z = u * rule.stopped(layer.scale) + rule.stopped(layer.bias)
        recording.tape.watch(z)
        self.records.append({"a": recording.check_batch(a, layer), "u": u,
                             "taps": [u, z]})
        return z

    def blocks(self, recording, tap_grads):
        d, p = self.layer.kernel.shape
        batch = recording.batch_size

        def rows(t, width):  # [B, positions, width], float32
            return tf.reshape(ops.cast(t, "float32"), [batch, -1, width])

        a, g_u, g_z, u = [], [], [], []
        for record, (grad_u, grad_z) in zip(self.records, tap_grads):
            a.append(rows(record["a"], d))
            u.append(rows(record["u"], p))
            g_u.append(rows(grad_u, p))
            g_z.append(rows(grad_z, p))
        a, u, g_u, g_z = (ops.concatenate(t, axis=1)
                          for t in (a, u, g_u, g_z))
        out = {}
        kernel = self.variable("kernel")
        if kernel is not None:
            matrix = dense.KernelMatrix.dense(d, p)
            out[id(kernel)] = [blocks.LinearBlock(
                a, g_u, matrix.to_matrix, matrix.from_matrix)]
        scale = self.variable("scale")
        if scale is not None:
            out[id(scale)] = [
                blocks.MaterializedBlock(ops.sum(u * g_z, axis=1))]
        bias = self.variable("bias")
        if bias is not None:
            out[id(bias)] = [blocks.MaterializedBlock(ops.sum(g_z, axis=1))]
        return out


class ScaledDenseSubclass(ScaledDense):
    """Only a constructor argument more: takes ScaledDense's rule."""

    def __init__(self, units, note="", **kwargs):
        super().__init__(units, **kwargs)
        self.note = note


class ScaledDenseOverridingCall(ScaledDense):

    def call(self, inputs, training=None):
        return super().call(inputs, training=training) * 2.0


def _model(input_shape, dropout=0.0):
    return helpers.sequential(
        input_shape, ScaledDense(5, dropout=dropout, name="scaled"),
        keras.layers.Flatten(), keras.layers.Dense(2, name="head"))


def _brute_force(model, x, y, clip):
    """The sum of the per-example gradients clipped to `clip`, and their
    norms: one `tf.GradientTape` per example."""
    loss = helpers.MSE
    variables = model.trainable_variables
    grads = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            value = loss(y[i:i + 1], model(x[i:i + 1], training=True))
        grads.append([g.numpy() for g in tape.gradient(value, variables)])
    norms = np.sqrt([sum(np.sum(g ** 2) for g in example)
                     for example in grads])
    factors = np.minimum(1.0, clip / norms)
    summed = [sum(f * example[k] for f, example in zip(factors, grads))
              for k in range(len(variables))]
    return summed, norms


class UserRuleTest(parameterized.TestCase):

    def setUp(self):
        super().setUp()
        # What other code of this process registered (e.g. the guide's
        # ScaledDense, run by tests/docs_test.py): left as it is.
        self.registered_before = dict(registry.USER_RULES)

    def tearDown(self):
        for cls in (ScaledDense, keras.layers.Dense):
            registry.USER_RULES.pop(cls, None)
        super().tearDown()

    @parameterized.named_parameters(
        ("matrix", (4,)), ("sequence", (3, 4)))
    def test_ghost_sum_is_brute_force(self, input_shape):
        tf_dpadam.register_ghost_rule(ScaledDense, ScaledDenseRule)
        model = _model(input_shape)
        self.assertEqual(ghost_clipping.describe(model), {
            "scaled": "ghost (ScaledDense)", "head": "ghost (Dense)"})
        x = helpers.normal((helpers.BATCH, *input_shape))
        y = helpers.normal((helpers.BATCH, 2), seed=1)
        _, norms = _brute_force(model, x, y, 1.0)
        clip = float(np.median(norms)) * 1.0001  # half of them clipped
        want, norms = _brute_force(model, x, y, clip)
        self.assertTrue(np.any(norms > clip) and np.any(norms < clip))
        model.compile(loss=helpers.MSE)
        got, ghost_norms, _, _ = helpers.ghost_clipped_sum(
            model, tf.constant(x), tf.constant(y), None, clip, None, False)
        np.testing.assert_allclose(ghost_norms, norms, rtol=1e-5)
        for variable, g, w in zip(model.trainable_variables, got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-7,
                                       err_msg=variable.path)

    @pytest.mark.slow
    def test_a_private_step_takes_the_rule(self):
        tf_dpadam.register_ghost_rule(ScaledDense, ScaledDenseRule)
        model = _model((4,))
        x = helpers.normal((helpers.BATCH, 4))
        y = helpers.normal((helpers.BATCH, 2), seed=1)
        _, norms = _brute_force(model, x, y, 1.0)
        clip = float(np.median(norms)) * 1.0001
        want, _ = _brute_force(model, x, y, clip)
        before = helpers.numpy_values(model.trainable_variables)
        private = helpers.noise_free_dpsgd_step(
            model, helpers.MSE, clip, x, y, clipping="ghost")
        self.assertEqual(private.clipping_used, "ghost")
        helpers.assert_update(model.trainable_variables, before,
                              [-w / helpers.BATCH for w in want])

    @pytest.mark.slow
    def test_a_layer_that_draws_needs_the_rule(self):
        # Its dropout keeps it from the fallback (whose per-example replay
        # would draw other masks).
        x = helpers.normal((helpers.BATCH, 4))
        y = helpers.normal((helpers.BATCH, 2), seed=1)

        def step(clipping):
            private = tf_dpadam.make_private(
                _model((4,), dropout=0.5), clipping=clipping)
            private.compile(optimizer=tf_dpadam.DPSGD(
                l2_norm_clip=1.0, noise_multiplier=0.0,
                batch_size=helpers.BATCH), loss=helpers.MSE)
            private.train_on_batch(x, y)
            return private

        with self.assertRaisesRegex(ValueError, "draws random numbers"):
            step("ghost")
        auto = step("auto")
        self.assertEqual(auto.clipping_used, "vectorized")
        self.assertIn("draws random numbers", auto.ghost_unsupported_reason)
        tf_dpadam.register_ghost_rule(ScaledDense, ScaledDenseRule)
        self.assertEqual(step("ghost").clipping_used, "ghost")

    def test_lookup_follows_subclasses(self):
        layers = [ScaledDense(2), ScaledDenseSubclass(2),
                  ScaledDenseOverridingCall(2)]
        for layer in layers:
            self.assertEqual(registry.ghost_rule(layer),
                             (None, f"no ghost rule for"
                                    f" {type(layer).__name__}"))
        tf_dpadam.register_ghost_rule(ScaledDense, ScaledDenseRule)
        self.assertEqual([registry.ghost_rule(layer) for layer in layers], [
            (ScaledDenseRule, None), (ScaledDenseRule, None),
            (None, "call is overridden")])
        registry.unregister_ghost_rule(ScaledDense)
        self.assertEqual(registry.ghost_rule(layers[0])[0], None)

    def test_the_latest_registration_wins(self):
        class OtherRule(ScaledDenseRule):
            name = "Other"

        tf_dpadam.register_ghost_rule(ScaledDense, ScaledDenseRule)
        tf_dpadam.register_ghost_rule(ScaledDense, OtherRule)
        self.assertIs(registry.ghost_rule(ScaledDense(2))[0], OtherRule)
        # Over a built-in rule too, until it is taken back.
        dense_layer = keras.layers.Dense(2)
        tf_dpadam.register_ghost_rule(keras.layers.Dense, OtherRule)
        self.assertIs(registry.ghost_rule(dense_layer)[0], OtherRule)
        registry.unregister_ghost_rule(keras.layers.Dense)
        self.assertIs(registry.ghost_rule(dense_layer)[0], dense.DenseRule)
        with self.assertRaisesRegex(ValueError, "layer_class 'Dense'"):
            registry.unregister_ghost_rule(keras.layers.Dense)

    def test_bad_arguments(self):

        class NoBlocks(rule.Rule):
            weight_names = ("kernel",)

            def intercept(self, recording, original, *args, **kwargs):
                return original(*args, **kwargs)

        class NoWeights(ScaledDenseRule):
            weight_names = ()

        class Fallback(ScaledDenseRule):
            kind = "fallback"

        for layer_class in (ScaledDense(2), "ScaledDense", int,
                            keras.layers.Layer):
            with self.assertRaisesRegex(ValueError, "layer_class"):
                tf_dpadam.register_ghost_rule(layer_class, ScaledDenseRule)
        for bad_rule in (ScaledDenseRule(ScaledDense(2), []), "rule", object,
                         rule.Rule, NoBlocks, NoWeights, Fallback):
            with self.assertRaisesRegex(ValueError, "rule must be"):
                tf_dpadam.register_ghost_rule(ScaledDense, bad_rule)
        self.assertEqual(registry.USER_RULES, self.registered_before)


if __name__ == "__main__":
    absltest.main()
