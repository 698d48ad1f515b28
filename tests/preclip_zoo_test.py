"""Scale-then-privatize and DiSK on the privacy zoo's models, against brute force.

The two optimizers change what is clipped (`tf_dpadam.privatizer.preclip`): s * g_j for
scale-then-privatize, (1 - w) g_j(theta) + w g_j(theta + shift) for DiSK.
For a selection of the zoo's models (`privacy_zoo_test`), one noise-free
step's clipped sum (the diagnostics' clean gradient, B = 1) must equal

    sum_j min(1, C / ||d_j||) d_j

with d_j computed from one-example `tf.GradientTape`s in eager mode (at the
shifted weights too, assigned to the model for the reference), the transform
and the clipping in NumPy (float64). The optimizer's state is set by hand to
a step t = 4 with a non-uniform preconditioner (scale-then-privatize) or a
non-zero shift (DiSK); C is just above the median norm. Both optimizers
run on the vectorized path and with `clipping="auto"`, which takes ghost
clipping (scaled norms; a second pass at the shifted weights) where the
model allows.
"""

import keras
import numpy as np
import pytest
from absl.testing import absltest
from absl.testing import parameterized

import tf_dpadam
from tf_dpadam.optimizers import disk
from tf_dpadam.optimizers import scale_then_privatize as stp

import privacy_zoo_test as zoo

pytestmark = pytest.mark.slow  # A model per case (about 2 minutes).

_ENTRIES = ("dense", "dense_on_sequences", "embedding_mask_pooling",
            "ws_conv2d_group_norm", "multi_head_attention_mask",
            "reversible_embedding_tied", "lora_dense_after_build",
            "weight_regularizers", "sample_weights", "multi_output",
            "activity_regularizer")
_STEPS_DONE = 3
_BETA_2 = 0.999
_SCALE_EPSILON = 1e-3
_KAPPA, _GAMMA = 0.7, 0.5


def _clipped_sum(vectors, clip):
    """sum_j min(1, C / ||d_j||) d_j, of `[example][variable]` arrays."""
    factors = np.minimum(1.0, clip / zoo._global_norms(vectors))
    return [sum(f * example[i] for f, example in zip(factors, vectors))
            for i in range(len(vectors[0]))]


def _median_clip(vectors):
    norms = zoo._global_norms(vectors)
    clip = float(np.median(norms)) * 1.0001
    assert np.sum(norms > clip) > 0 and np.sum(norms < clip) > 0, norms
    return clip


def _scale_then_privatize_reference(case, rng):
    """`(velocities, C, expected)` for scale-then-privatize."""
    variables = case.model.trainable_variables
    velocities = [rng.uniform(0.01, 1.0, size=v.shape) ** 4
                  for v in variables]
    correction = 1 - _BETA_2**_STEPS_DONE
    denominators = [np.sqrt(v / correction) + _SCALE_EPSILON
                    for v in velocities]
    rms = np.sqrt(np.mean(np.concatenate(
        [d.ravel() for d in denominators]) ** 2))
    scales = [rms / d for d in denominators]
    vectors = [[g * s for g, s in zip(example, scales)]
               for example in zoo._per_example_gradients(case)]
    clip = _median_clip(vectors)
    return velocities, clip, _clipped_sum(vectors, clip)


def _scale_then_privatize(variables, velocities, clip):
    """`(optimizer, set_state)` for scale-then-privatize."""
    optimizer = stp.DPAdamScaleThenPrivatize(
        l2_norm_clip=clip, noise_multiplier=0.0, batch_size=1,
        learning_rate=0.0, beta_2=_BETA_2, scale_epsilon=_SCALE_EPSILON)

    def set_state():
        for v, velocity in zip(variables, velocities):
            optimizer.moments(v)[1].assign(velocity.astype("float32"))

    return optimizer, set_state


def _disk_reference(case, rng):
    """`(moves, C, expected)` for DiSK."""
    variables = case.model.trainable_variables
    weights = [np.array(v) for v in variables]
    moves = [0.05 * rng.normal(size=v.shape) for v in variables]
    here = zoo._per_example_gradients(case)
    for v, w, move in zip(variables, weights, moves):
        v.assign((w + _GAMMA * move).astype(v.dtype))
    there = zoo._per_example_gradients(case)
    for v, w in zip(variables, weights):
        v.assign(w)
    share = disk.shift_weight(_KAPPA, _GAMMA)
    vectors = [[(1 - share) * a + share * b for a, b in zip(x, y)]
               for x, y in zip(here, there)]
    clip = _median_clip(vectors)
    return moves, clip, _clipped_sum(vectors, clip)


def _disk(variables, moves, clip):
    """`(optimizer, set_state)` for DiSK."""
    weights = [np.array(v) for v in variables]
    optimizer = disk.DPAdamDiSK(
        l2_norm_clip=clip, noise_multiplier=0.0, batch_size=1,
        learning_rate=0.0, kappa=_KAPPA, gamma=_GAMMA)

    def set_state():
        for v, w, move in zip(variables, weights, moves):
            optimizer.state(v)[0].assign((w - move).astype(v.dtype))

    return optimizer, set_state


# name -> (reference, optimizer): the reference gives `(state, C, expected)`
# of a case, the optimizer `(optimizer, set_state)` from its variables,
# state and C.
_OPTIMIZERS = {
    "scale_then_privatize": (_scale_then_privatize_reference,
                             _scale_then_privatize),
    "disk": (_disk_reference, _disk),
}

# (entry, optimizer) -> (weights before the step, state, C, expected):
# computed once, its brute force (one-example tapes, twice for DiSK) shared
# by the cases of the entry and optimizer (clippings, XLA). Every case
# builds its model afresh; the build is deterministic (seeded), which
# `_reference` checks on each case's weights.
_REFERENCES = {}


def _reference(name, optimizer_name, case):
    """`(state, C, expected)` of `case` (the entry `name`), cached."""
    key = (name, optimizer_name)
    before = zoo._values(case.model.trainable_variables)
    if key not in _REFERENCES:
        reference, _ = _OPTIMIZERS[optimizer_name]
        # The reference leaves the weights as they were (DiSK's restores
        # them after its pass at the shifted weights).
        state, clip, want = reference(case, np.random.default_rng(7))
        _REFERENCES[key] = (before, state, clip, want)
    cached, state, clip, want = _REFERENCES[key]
    for b, c in zip(before, cached):
        np.testing.assert_array_equal(b, c)
    return state, clip, want


# Scale-then-privatize's ghost norms (`ghost_clipping.blocks`, scale_sq):
# every entry but this takes them under clipping="auto" (ghost clipping
# refuses activity regularizers; WSConv2D's standardized kernel materializes
# each example's kernel gradient).
_STP_NOT_GHOST = ("activity_regularizer",)
# More of ghost clipping's blocks under a scale (scale-then-privatize with
# clipping="auto" only): convolutions (patches), repeated embedding ids
# (one segment per id), layer normalization, keras-hub's position
# embedding and LoRA on a convolution.
_STP_GHOST_ENTRIES = ("conv2d_same_strided", "conv1d_strided_groups",
                      "embedding_repeated_ids", "layer_norm",
                      "position_embedding",
                      "lora_conv2d_same_strided_after_build")


# DiSK's second pass (`ghost_clipping.clipped_gradient_sum(shifts=...)`):
# every entry but this takes ghost clipping under clipping="auto" (ghost
# clipping refuses activity regularizers). The blocks of WSConv2D's and
# LoRA's rules read their weights where the record's pass read them (see
# `Rule.shifted_pass`).
_DISK_NOT_GHOST = ("activity_regularizer",)
_DISK_GHOST_ENTRIES = ("conv2d_same_strided", "conv1d_strided_groups",
                       "embedding_repeated_ids", "layer_norm",
                       "position_embedding")


def _cases():
    for name in _ENTRIES:
        yield (f"_{name}_disk", name, "disk", False, "vectorized",
               "vectorized")
        yield (f"_{name}_disk_auto", name, "disk", False, "auto",
               "vectorized" if name in _DISK_NOT_GHOST else "ghost")
        yield (f"_{name}_scale_then_privatize", name, "scale_then_privatize",
               False, "vectorized", "vectorized")
        yield (f"_{name}_scale_then_privatize_auto", name,
               "scale_then_privatize", False, "auto",
               "vectorized" if name in _STP_NOT_GHOST else "ghost")
    for name in _STP_GHOST_ENTRIES:
        yield (f"_{name}_scale_then_privatize_auto", name,
               "scale_then_privatize", False, "auto", "ghost")
    for name in _DISK_GHOST_ENTRIES:
        yield (f"_{name}_disk_auto", name, "disk", False, "auto", "ghost")
    for optimizer in _OPTIMIZERS:
        yield (f"_dense_{optimizer}_xla", "dense", optimizer, True,
               "vectorized", "vectorized")
    yield ("_dense_scale_then_privatize_ghost_xla", "dense",
           "scale_then_privatize", True, "ghost", "ghost")
    yield ("_dense_disk_ghost_xla", "dense", "disk", True, "ghost", "ghost")


class PreclipZooTest(parameterized.TestCase):

    @parameterized.named_parameters(_cases())
    def test_one_step(self, name, optimizer_name, jit, clipping, used):
        self.assertIsNone(zoo._ZOO[name].refused)
        case = zoo._build(name)
        model = case.model
        before = zoo._values(model.trainable_variables)
        state, clip, want = _reference(name, optimizer_name, case)
        for b, a in zip(before, zoo._values(model.trainable_variables)):
            np.testing.assert_array_equal(a, b)
        optimizer, set_state = _OPTIMIZERS[optimizer_name][1](
            model.trainable_variables, state, clip)
        private = tf_dpadam.make_private(model, seed=0, diagnostics=True,
                                         clipping=clipping)
        private.compile(optimizer=optimizer, loss=case.loss,
                        loss_weights=case.loss_weights, jit_compile=jit)
        self.assertTrue(optimizer.built)
        optimizer.iterations.assign(_STEPS_DONE)
        set_state()
        private.train_on_batch(case.x, case.y,
                               sample_weight=case.sample_weight)
        self.assertEqual(private.clipping_used, used,
                         private.ghost_unsupported_reason)
        got = [np.asarray(keras.ops.convert_to_numpy(v), "float64")
               for v in private.clean_gradients]
        error = np.sqrt(sum(np.sum(np.square(g - w))
                            for g, w in zip(got, want)))
        size = np.sqrt(sum(np.sum(np.square(w)) for w in want))
        self.assertGreater(size, 0.0)
        self.assertLess(error / size, 1e-4)
        # The learning rate is 0: nothing moved.
        for b, a in zip(before, zoo._values(model.trainable_variables)):
            np.testing.assert_array_equal(a, b)


if __name__ == "__main__":
    absltest.main()
