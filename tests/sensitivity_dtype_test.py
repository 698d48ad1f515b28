"""Sensitivity C whatever the dtype policy and the data (issue 33, items 2-3).

The guarantee needs that removing one example moves the clipped sum S by at
most C. Two ways it failed:

* under a `bfloat16` (or `float16`) dtype policy the clipped sum was
  accumulated, and the noise drawn, in the variables' 16-bit dtype: the sum
  was rounded to 8 bits of mantissa, an error that grows with |S|, not with
  C (a remove-one sensitivity of 1.17 C was measured at B = 256);
* one example with an `inf` feature turned every weight into NaN.

Each case measures the remove-one sensitivity (`sensitivity.py`) for every
row, checks that the step's sum is additive over its own per-example parts
(what a 16-bit sum breaks, on any CPU), and compares the clipped sum with an
independent float64 NumPy reference: per-example gradients from one-example
`tf.GradientTape`s, clipped and summed in NumPy.
"""

import keras
import numpy as np
import tensorflow as tf
import pytest
from absl.testing import absltest
from absl.testing import parameterized

import tf_dpadam

import sensitivity

pytestmark = pytest.mark.slow  # Trains under several dtype policies.

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16", "float16",
            "bfloat16")
CLIPPINGS = ("auto", "ghost", "vectorized")
_LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
# Every example's gradient norm is well above C, so every one is clipped to
# norm C, and the gradients are aligned: |S| is close to B C, the regime in
# which a sum rounded to 16 bits errs most (its error grows with |S|).
C = 0.01
B = 64
# Removing one example moves S by at most C: float32 accumulation of B terms
# of norm <= C errs by about B 2^-24 |S| <= B^2 C 6e-8 = 2.4e-4 C in the
# worst case and by far less in practice (1e-6 C measured); a sum rounded
# to bfloat16 errs by up to 2^-9 |S| = 0.125 C here (1.17 C at B = 256).
# (Before the fix these cases failed: under bfloat16 the vectorized path's
# sensitivity was 1.03 and the ghost path's sum was 0.105 C off.)
SENSITIVITY_TOLERANCE = 1e-4
# The tight check that S is accumulated in float32 uses only the library's
# own numbers, so it holds on every CPU whatever its 16-bit kernels do: with
# c_j = S(D) - S(D without j) (example j's clipped gradient as the step
# computed it), sum_j c_j must equal S(D). Each of the B + 1 float32 sums
# errs by about 2^-24 |S| per coordinate, and those errors add up over the
# B differences: measured 2.6e-4 to 4.6e-4 C here, float32 policy
# included. A sum rounded to bfloat16 errs by up to 2^-9 |S| per coordinate
# instead, 2^15 times more: on this batch's exact parts a bfloat16 sum
# gives 8 C and a float16 one 0.9 C (`test_tolerance_rejects_a_bfloat16_sum`
# asserts more than 1 C), one float32 rounding 1.1e-4 C.
ADDITIVITY_TOLERANCE = 1e-2
# ||S - S_reference|| / C against the float64 sum of one-example tapes
# (`sum_tolerance`): that the step computes the right per-example gradients.
# Where the model computes in float32 S must match to float32 rounding.
# Under a 16-bit compute dtype the per-example gradients are rounded to it
# (unit roundoff u) in different ways by the step and by the one-example
# tape, and how depends on the CPU: where oneDNN and hardware bfloat16 are
# missing (AMD EPYC, 2026-11-26), Eigen rounds after each multiply-add and
# the tapes' own sum differed from the step's by 0.06-0.11 C on these
# aligned gradients, where a CPU with both measured B u C / 10. Aligned,
# the B roundings can add up, so the tolerance is B u C (0.25 C for
# bfloat16): it catches a wrong gradient, and the additivity check above
# catches a 16-bit sum.
UNIT_ROUNDOFF = {"float32": 2.0**-24, "mixed_float16": 2.0**-11,
                 "float16": 2.0**-11, "mixed_bfloat16": 2.0**-8,
                 "bfloat16": 2.0**-8}


def sum_tolerance(policy):
    """The tolerance of ||S - S_reference|| / C (see `UNIT_ROUNDOFF`)."""
    if policy == "float32":
        # The same per-example gradients as the tapes (measured: 8e-6 C):
        # only float32 rounding of the sum, |S| 2^-24 per coordinate.
        return 5e-5
    return B * UNIT_ROUNDOFF[policy]


def additivity_error(full, withouts):
    """||sum_j (S - S_without_j) - S|| / C: 0 for an exact sum."""
    parts = [[f - w for f, w in zip(full, without)] for without in withouts]
    total = [sum(p[k] for p in parts) for k in range(len(full))]
    return sensitivity.distance(total, full) / C


def use_policy(test, name):
    """Sets the global dtype policy for one test, restored afterwards."""
    previous = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(name)
    test.addCleanup(keras.mixed_precision.set_global_policy, previous)


def mlp(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(16, activation="tanh"),
        keras.layers.Dense(4),
    ])


def conv(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((6, 6, 1)),
        keras.layers.Conv2D(3, 3, activation="tanh"),
        keras.layers.Flatten(),
        keras.layers.Dense(3),
    ])


def sequence(seed=0):
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((5,), dtype="int32"),
        keras.layers.Embedding(12, 8),
        keras.layers.GlobalAveragePooling1D(),
        keras.layers.Dense(3),
    ])


MODELS = {"mlp": mlp, "conv": conv, "sequence": sequence}


def aligned_batch(kind, n=B, seed=0):
    """A batch whose per-example gradients point in similar directions."""
    rng = np.random.default_rng(seed)
    y = np.zeros(n, "int64")
    if kind == "sequence":
        return rng.integers(1, 4, size=(n, 5)).astype("int32"), y
    shape = {"mlp": (n, 8), "conv": (n, 6, 6, 1)}[kind]
    return (1.0 + 0.25 * rng.normal(size=shape)).astype("float32"), y


def reference_clipped_parts(model, x, y, l2_norm_clip):
    """`(parts, skipped)`: clip(g_i, C) in float64 for each example whose
    one-example gradient and loss are finite, and the skipped rows."""
    variables = model.trainable_variables
    parts = []
    skipped = []
    for i in range(len(y)):
        with tf.GradientTape() as tape:
            loss = _LOSS(y[i:i + 1], model(x[i:i + 1], training=True))
        grads = [np.asarray(tf.cast(tf.convert_to_tensor(g), tf.float64))
                 for g in tape.gradient(loss, variables)]
        norm = np.sqrt(sum(np.sum(g**2) for g in grads))
        if not (np.isfinite(norm) and np.isfinite(float(loss))):
            skipped.append(i)
            continue
        factor = min(1.0, l2_norm_clip / norm) if norm > 0 else 1.0
        parts.append([factor * g for g in grads])
    return parts, skipped


def reference_clipped_sum(model, x, y, l2_norm_clip):
    """`(sum, skipped)`: sum_i clip(g_i, C) in float64 over the examples
    whose one-example gradient and loss are finite, and the skipped rows."""
    parts, skipped = reference_clipped_parts(model, x, y, l2_norm_clip)
    total = [sum(p[k] for p in parts) for k in range(len(parts[0]))]
    return total, skipped


class DtypePolicyTest(parameterized.TestCase):

    def check(self, policy, clipping, jit_compile, kind="mlp"):
        use_policy(self, policy)
        model = MODELS[kind]()
        x, y = aligned_batch(kind)
        full, withouts = sensitivity.remove_one_sums(
            model, _LOSS, x, y, C, removed=range(B), clipping=clipping,
            jit_compile=jit_compile)
        sens = max(sensitivity.distance(full, w) / C for w in withouts)
        self.assertLessEqual(sens, 1.0 + SENSITIVITY_TOLERANCE)
        self.assertLess(additivity_error(full, withouts),
                        ADDITIVITY_TOLERANCE)
        reference, skipped = reference_clipped_sum(model, x, y, C)
        self.assertEqual(skipped, [])
        size = sensitivity.distance(reference, [0 * r for r in reference])
        # Aligned: |S| is more than half of B C (a 16-bit sum errs most).
        self.assertGreater(size, 0.5 * B * C)
        error = sensitivity.distance(full, reference) / C
        self.assertLess(error, sum_tolerance(policy))

    @parameterized.product(policy=POLICIES, clipping=CLIPPINGS)
    def test_mlp_graph(self, policy, clipping):
        self.check(policy, clipping, jit_compile=False)

    @parameterized.parameters("float32", "mixed_float16", "bfloat16")
    def test_mlp_xla(self, policy):
        self.check(policy, "auto", jit_compile=True)

    def test_mlp_xla_vectorized(self):
        self.check("bfloat16", "vectorized", jit_compile=True)

    @parameterized.product(
        policy=("bfloat16", "mixed_float16"), clipping=("auto", "vectorized"),
        kind=("conv", "sequence"))
    def test_conv_and_sequence(self, policy, clipping, kind):
        self.check(policy, clipping, jit_compile=False, kind=kind)

    def test_tolerance_rejects_a_bfloat16_sum(self):
        # The old path: every clipped sum rounded to bfloat16 (the
        # variables' dtype), here applied to the exact per-example parts.
        use_policy(self, "bfloat16")
        model = mlp()
        x, y = aligned_batch("mlp")
        parts, _ = reference_clipped_parts(model, x, y, C)

        def bfloat16_sum(rows):
            total = [sum(parts[i][k] for i in rows)
                     for k in range(len(parts[0]))]
            return [np.asarray(tf.cast(tf.cast(t, tf.bfloat16), tf.float64))
                    for t in total]

        full = bfloat16_sum(range(B))
        withouts = [bfloat16_sum([i for i in range(B) if i != j])
                    for j in range(B)]
        self.assertGreater(additivity_error(full, withouts),
                           100 * ADDITIVITY_TOLERANCE)  # More than 1 C.
        exact = [sum(p[k] for p in parts) for k in range(len(parts[0]))]
        exact_withouts = [[f - p for f, p in zip(exact, parts[j])]
                          for j in range(B)]
        self.assertLess(additivity_error(exact, exact_withouts), 1e-9)
        # And one final rounding moves S by more than the remove-one
        # tolerance allows.
        self.assertGreater(sensitivity.distance(full, exact) / C,
                           SENSITIVITY_TOLERANCE)

    def test_private_gradient_is_float32_until_the_optimizer(self):
        use_policy(self, "bfloat16")
        model = tf_dpadam.make_private(mlp(), seed=0, diagnostics=True)
        model.compile(
            optimizer=tf_dpadam.DPAdamCorrected(
                l2_norm_clip=C, noise_multiplier=1.0, batch_size=B,
                gradient_accumulation_steps=2),
            loss=_LOSS)
        x, y = aligned_batch("mlp")
        model.train_on_batch(x, y)
        self.assertTrue(all(v.dtype == "bfloat16"
                            for v in model.trainable_variables))
        self.assertTrue(all(v.dtype == "float32"
                            for v in model.clean_gradients))
        accumulator = model.optimizer.dp_accumulator
        self.assertTrue(all(v.dtype == "float32" for v in accumulator.sums))


def with_non_finite_rows(x, rows):
    """`x` with an `inf` feature in rows[0] and a NaN one in rows[1]."""
    x = np.array(x)
    x.reshape(len(x), -1)[rows[0], 0] = np.inf
    x.reshape(len(x), -1)[rows[1], 1] = np.nan
    return x


class NonFiniteExampleTest(parameterized.TestCase):

    # ("auto" is ghost clipping for these models.)
    @parameterized.parameters(
        ("auto", False, "mlp"), ("ghost", False, "mlp"),
        ("vectorized", False, "mlp"), ("ghost", True, "mlp"),
        ("vectorized", True, "mlp"), ("ghost", False, "conv"),
        ("vectorized", False, "conv"))
    def test_contributes_nothing(self, clipping, jit_compile, kind,
                                 policy="float32"):
        use_policy(self, policy)
        bad = (3, 5)
        x, y = aligned_batch(kind, n=16)
        x = with_non_finite_rows(x, bad)
        model = MODELS[kind]()
        probe = sensitivity.private_probe(model, _LOSS, C, clipping=clipping,
                                          jit_compile=jit_compile)
        full = sensitivity.clipped_sum(probe, x, y)
        # The diagnostics (NOT private) count them; nothing else shows them.
        self.assertEqual(float(probe.non_finite_examples), len(bad))
        reference, skipped = reference_clipped_sum(model, x, y, C)
        self.assertEqual(skipped, list(bad))
        self.assertLess(sensitivity.distance(full, reference) / C, 1e-5)
        counted = len(bad)
        for j in (*bad, 0):
            keep = np.arange(len(y)) != j
            without = sensitivity.clipped_sum(probe, x[keep], y[keep])
            moved = sensitivity.distance(full, without) / C
            self.assertLessEqual(moved, 1.0 + SENSITIVITY_TOLERANCE)
            if j in bad:  # Removing it changes nothing (but rounding).
                self.assertLess(moved, 1e-5)
            counted += len(bad) - (j in bad)
            self.assertEqual(float(probe.non_finite_examples), counted)

        # A noisy step with the default (secret) noise seed.
        private = tf_dpadam.make_private(model, clipping=clipping)
        private.compile(
            optimizer=tf_dpadam.DPAdamCorrected(
                l2_norm_clip=C, noise_multiplier=1.0, batch_size=16,
                learning_rate=0.1),
            loss=_LOSS, jit_compile=jit_compile)
        logs = private.train_on_batch(x, y, return_dict=True)
        self.assertEqual(private.clipping_used,
                         "vectorized" if clipping == "vectorized" else "ghost")
        self.assertTrue(np.isfinite(logs["loss"]))
        self.assertIsNone(private.non_finite_examples)
        for v in private.trainable_variables:
            self.assertTrue(np.all(np.isfinite(keras.ops.convert_to_numpy(v))))

    @parameterized.parameters("ghost", "vectorized")
    def test_bfloat16_with_non_finite_rows(self, clipping):
        use_policy(self, "bfloat16")
        x, y = aligned_batch("mlp", n=16)
        x = with_non_finite_rows(x, (0, 7))
        sens, full = sensitivity.remove_one_sensitivity(
            mlp(), _LOSS, x, y, C, clipping=clipping, removed=(0, 7, 1))
        self.assertLessEqual(sens, 1.0 + SENSITIVITY_TOLERANCE)
        self.assertTrue(all(np.all(np.isfinite(f)) for f in full))

    def test_non_finite_label_loss(self):
        # A NaN in the loss (here from a NaN regression target) with finite
        # inputs: the example contributes nothing either.
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
        x = np.ones((4, 3), "float32")
        y = np.array([[1.0], [np.nan], [1.0], [np.inf]], "float32")
        for clipping in ("ghost", "vectorized"):
            private = tf_dpadam.make_private(model, seed=0, clipping=clipping,
                                             diagnostics=True)
            private.compile(
                optimizer=tf_dpadam.DPSGD(l2_norm_clip=1.0,
                                          noise_multiplier=0.0, batch_size=1,
                                          learning_rate=0.0),
                loss="mse")
            private.train_on_batch(x, y)
            self.assertEqual(float(private.non_finite_examples), 2.0)
            clean = [keras.ops.convert_to_numpy(v)
                     for v in private.clean_gradients]
            single = [keras.ops.convert_to_numpy(v) for v in
                      _one_example_clipped(model, x[:1], y[:1], 1.0)]
            for c, s in zip(clean, single):
                np.testing.assert_allclose(c, 2 * s, rtol=1e-6, atol=1e-7)


def _one_example_clipped(model, x, y, l2_norm_clip):
    with tf.GradientTape() as tape:
        loss = keras.losses.MeanSquaredError()(y, model(x, training=True))
    grads = tape.gradient(loss, model.trainable_variables)
    norm = float(tf.linalg.global_norm(grads))
    return [g * min(1.0, l2_norm_clip / norm) for g in grads]


if __name__ == "__main__":
    absltest.main()
