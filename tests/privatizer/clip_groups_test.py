"""Per-layer (group-wise) clipping: the groups, the clipped sum against
one-example tapes clipped by hand, and the noise and Phi from
sqrt(sum_l C_l^2)."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl.testing import absltest
from absl.testing import parameterized

import tf_dpadam
from tf_dpadam.privatizer import clip_groups
from tf_dpadam.privatizer import noise

PATHS = ["sequential/dense/kernel", "sequential/dense/bias",
         "sequential/head/kernel", "sequential/head/bias"]


class AssignTest(parameterized.TestCase):

    def test_flat(self):
        self.assertEqual(clip_groups.assign(PATHS, 2.0, False),
                         (["all"], [2.0], [0, 0, 0, 0]))

    def test_per_layer_splits_c_equally(self):
        names, clips, group_of = clip_groups.assign(PATHS, 2.0, True)
        self.assertEqual(names, ["sequential/dense", "sequential/head"])
        np.testing.assert_allclose(clips, [2 / np.sqrt(2)] * 2)
        self.assertAlmostEqual(clip_groups.total_clip_norm(clips), 2.0)
        self.assertEqual(group_of, [0, 0, 1, 1])

    @parameterized.parameters(
        ({"dense": 1.0, "head": 2.0}, [0, 0, 1, 1]),
        ({"sequential": 1.0, "head": 2.0}, [0, 0, 1, 1]),  # most specific
        ({"sequential/dense": 1.0, "sequential": 3.0}, [0, 0, 1, 1]),
    )
    def test_mapping_keys_match_leading_path_components(self, spec, want):
        names, clips, group_of = clip_groups.assign(PATHS, spec, False)
        self.assertEqual(names, list(spec))
        self.assertEqual(clips, list(spec.values()))
        self.assertEqual(group_of, want)

    def test_bad_mappings_are_refused(self):
        with self.assertRaisesRegex(ValueError, "no key matches"):
            clip_groups.assign(PATHS, {"dense": 1.0}, False)
        with self.assertRaisesRegex(ValueError, "match none"):
            clip_groups.assign(PATHS, {"dense": 1.0, "head": 1.0,
                                       "other": 1.0}, False)
        # "ense" is not a whole component.
        with self.assertRaisesRegex(ValueError, "no key matches"):
            clip_groups.assign(PATHS, {"ense": 1.0, "head": 1.0}, False)

    def test_spec_checks_name_the_argument(self):
        for bad in ({}, {"d": -1.0}, {"": 1.0}, {"d": float("inf")}):
            with self.assertRaisesRegex(ValueError, "l2_norm_clip"):
                tf_dpadam.DPSGD(l2_norm_clip=bad, noise_multiplier=1.0)
        with self.assertRaisesRegex(ValueError, "per_layer_clipping"):
            tf_dpadam.DPSGD(l2_norm_clip=1.0, noise_multiplier=1.0,
                            per_layer_clipping="yes")

    def test_config_round_trip(self):
        opt = tf_dpadam.DPAdamCorrected(
            l2_norm_clip={"dense": 0.5, "head": 1.0}, noise_multiplier=1.0,
            batch_size=32, target_unclipped_quantile=0.4)
        config = opt.get_config()
        self.assertEqual(config["l2_norm_clip"], {"dense": 0.5, "head": 1.0})
        again = tf_dpadam.DPAdamCorrected.from_config(config)
        self.assertEqual(again.clip_spec, {"dense": 0.5, "head": 1.0})
        self.assertEqual(again.adaptive_clipping, opt.adaptive_clipping)
        self.assertAlmostEqual(again.dp_config.l2_norm_clip,
                               np.hypot(0.5, 1.0))


def cnn(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6, 6, 2)),
        keras.layers.Conv2D(3, 3, activation="tanh", name="conv"),
        keras.layers.Flatten(),
        keras.layers.Dense(4, activation="tanh", name="hidden"),
        keras.layers.Dense(3, name="head"),
    ])


LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.mark.slow
class BruteForceTest(parameterized.TestCase):
    """Against one-example `GradientTape`s, each group clipped by hand."""

    @parameterized.product(
        clipping=["ghost", "vectorized"], jit=[False, True],
        spec=[("per_layer", 0.9), ("mapping", {"conv": 0.05, "hidden": 0.3,
                                                "head": 2.0})])
    def test_clipped_sum_matches_explicit_group_clipping(self, clipping, jit,
                                                         spec):
        rng = np.random.default_rng(0)
        x = rng.normal(size=(5, 6, 6, 2)).astype("float32") * 3
        y = rng.integers(0, 3, size=5)
        kind, value = spec
        model = cnn()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            private = tf_dpadam.make_private(model, clipping=clipping,
                                             seed=0, diagnostics=True)
        opt = tf_dpadam.DPSGD(l2_norm_clip=value, noise_multiplier=0.0,
                              batch_size=1, learning_rate=0.0,
                              per_layer_clipping=kind == "per_layer")
        private.compile(optimizer=opt, loss=LOSS, jit_compile=jit)
        private.train_on_batch(x, y)
        got = [np.asarray(g, "float64") for g in private.clean_gradients]

        variables = model.trainable_variables
        groups = opt.variable_groups()
        clips = np.asarray(opt.clip_norms(), "float64")
        self.assertLen(clips, 3)
        want = [np.zeros(v.shape) for v in variables]
        flat = [np.zeros(v.shape) for v in variables]
        total = np.sqrt(np.sum(clips ** 2))
        for i in range(len(x)):
            with tf.GradientTape() as tape:
                loss = LOSS(y[i:i + 1], model(x[i:i + 1], training=True))
            grads = [np.asarray(g, "float64")
                     for g in tape.gradient(loss, variables)]
            for group, clip in enumerate(clips):
                members = [k for k, g in enumerate(groups) if g == group]
                norm = np.sqrt(sum(np.sum(grads[k] ** 2) for k in members))
                for k in members:
                    want[k] += grads[k] * min(1.0, clip / norm)
            norm = np.sqrt(sum(np.sum(g ** 2) for g in grads))
            for k, g in enumerate(grads):
                flat[k] += g * min(1.0, total / norm)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=2e-4, atol=1e-6)
        # Clipping by groups is not clipping to their total norm.
        self.assertGreater(
            max(np.max(np.abs(g - f)) for g, f in zip(got, flat)), 1e-3)


class NoiseTest(absltest.TestCase):

    def test_noise_and_phi_use_sqrt_of_the_summed_squares(self):
        # Zero gradients (x = 0, no bias): DPSGD(lr=1) moves each weight by
        # minus the noise / B, whose std must be sigma sqrt(sum_l C_l^2) / B.
        keras.utils.set_random_seed(0)
        model = keras.Sequential([
            keras.Input((50,)),
            keras.layers.Dense(100, use_bias=False, name="a"),
            keras.layers.Dense(100, use_bias=False, name="b")])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            private = tf_dpadam.make_private(model, seed=0)
        sigma, b, clips = 0.7, 4, {"a": 0.3, "b": 0.4}
        opt = tf_dpadam.DPSGD(l2_norm_clip=clips, noise_multiplier=sigma,
                              batch_size=b, learning_rate=1.0)
        private.compile(optimizer=opt, loss="mse")
        before = [v.numpy() for v in model.trainable_variables]
        private.train_on_batch(np.zeros((b, 50), "float32"),
                               np.zeros((b, 100), "float32"))
        moved = np.concatenate([np.ravel(v.numpy() - w) for v, w in
                                zip(model.trainable_variables, before)])
        # 15,000 draws: the std's relative standard error is ~0.6%.
        self.assertAlmostEqual(moved.std() / (sigma * 0.5 / b), 1.0,
                               delta=0.03)
        phi = tf_dpadam.DPAdamCorrected(
            l2_norm_clip=clips, noise_multiplier=sigma, batch_size=b)
        zeros = [tf.zeros(v.shape) for v in model.trainable_variables]
        phi.build(model.trainable_variables)
        # The step's privatizer: sigma times the total C, over B.
        _, step_phi = noise.divide(zeros, phi.gradient_noise_stddev(), b)
        phi.apply_private(zeros, model.trainable_variables, step_phi)
        self.assertAlmostEqual(float(phi.step_phi()), (sigma * 0.5 / b) ** 2,
                               places=7)


if __name__ == "__main__":
    absltest.main()
