"""Fixtures shared by the library's test files.

Small data, models and seeds; ghost clipping in lockstep with explicit
clipping; a hand-made diagnostics snapshot; tiny BERT models. The research
harness's fixtures (recorded runs, fake training) are in
research/tests/research_helpers.py: nothing here imports `research`.
"""

import os
import random

import dp_accounting
import keras
import numpy as np
import tensorflow as tf

import tf_dpadam
from tf_dpadam.privatizer import dp_math
from tf_dpadam.privatizer import ghost_clipping
from tf_dpadam.common import compat
from tf_dpadam.privatizer import clipping
from tf_dpadam.tools.diagnostics import moments

LOSS = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

# tests/ and the repository root, for test modules in any subfolder.
TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(TESTS_DIR)


def reference_accountant(name):
    """dp-accounting's own accountant as the ledger configures it: "pld"
    (add-or-remove-one, the package's value discretization) or else RDP
    over `RDP_ORDERS`; for independent expected epsilons."""
    adjacency = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    if name == "pld":
        return dp_accounting.pld.PLDAccountant(
            adjacency, value_discretization_interval=(
                tf_dpadam.accounting.PLD_VALUE_DISCRETIZATION_INTERVAL))
    return dp_accounting.rdp.RdpAccountant(
        list(tf_dpadam.accounting.RDP_ORDERS), adjacency)


def covariance_standard_errors(measured, expected, size):
    """The largest |measured - expected| over the entries of a covariance
    matrix estimated from `size` independent coordinates, in standard
    errors of each entry's estimate, sqrt((S_ss S_tt + S_st^2) / size)
    around the expected S."""
    diagonal = np.diag(expected)
    error = np.sqrt((np.outer(diagonal, diagonal) + expected**2) / size)
    return float(np.max(np.abs(measured - expected) / error))


def seeded_poisson_batches(test, data, **kwargs):
    """`tf_dpadam.data.poisson_batches` with an explicit seed, which must
    warn."""
    with test.assertWarnsRegex(
            UserWarning, r"poisson_batches uses the explicit seed=\d+: anyone"
            " who knows it can regenerate every batch"):
        return tf_dpadam.data.poisson_batches(data, **kwargs)


def indexed_data(n):
    """`(x, y)` of n examples whose labels are their indices."""
    return np.zeros((n, 1), "float32"), np.arange(n)


def classification_data(n, d=6, classes=3, seed=0):
    """`n` standard-normal float32 rows of width `d` and integer labels."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype("float32")
    y = rng.integers(0, classes, size=n)
    return x, y


def mlp(d=6, classes=3, hidden=8, seed=0, kernel_regularizer=None):
    """Dense(hidden, tanh) -> Dense(classes) logits, seeded."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential([
        keras.Input((d,)),
        keras.layers.Dense(hidden, activation="tanh",
                           kernel_regularizer=kernel_regularizer),
        keras.layers.Dense(classes),
    ])


def numpy_values(variables):
    """The current values of Keras variables (or tensors) as NumPy arrays."""
    return [np.array(keras.ops.convert_to_numpy(v)) for v in variables]


def seed_everything(seed):
    """What scripts do: every global seed there is."""
    keras.utils.set_random_seed(seed)
    tf.random.set_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


# Ghost clipping in lockstep with explicit per-example clipping.

BATCH = 8
MSE = keras.losses.MeanSquaredError()


def rng(seed=0):
    return np.random.default_rng(seed)


def normal(shape, seed=0):
    """Standard-normal float32 values."""
    return rng(seed).normal(size=shape).astype("float32")


def sequential(input_shape, *layers, seed=0, dtype="float32"):
    """`keras.Sequential([keras.Input(input_shape), *layers])`, seeded."""
    keras.utils.set_random_seed(seed)
    return keras.Sequential(
        [keras.Input(input_shape, dtype=dtype), *layers]
    )


def reference_per_example_gradients(model, loss, x, y, sample_weight=None):
    """Explicit per-example gradients (vectorized map over one example)."""
    variables = model.trainable_variables

    def example_loss(x1, y1, w1):
        pred = model(x1, training=True)
        value = loss(y1, pred, sample_weight=w1)
        for extra in model.losses:
            value = value + keras.ops.sum(extra)
        return value, pred

    @tf.function
    def run(x, y, w):
        grads, losses, _ = clipping.per_example_gradients(
            example_loss, variables, (x, y, w)
        )
        return grads, losses

    return run(x, y, sample_weight)


def ghost_clipped_sum(model, x, y, sample_weight, clip, mask, jit,
                      dynamic_batch=False):
    """`ghost_clipping.clipped_gradient_sum` in a `tf.function`."""
    loss_fn = ghost_clipping.compiled_loss_fn(model)

    @tf.function(jit_compile=jit)
    def run(x, y, w, mask):
        return ghost_clipping.clipped_gradient_sum(
            model, loss_fn, x, y, w, clip, mask=mask
        )

    args = (x, y, sample_weight, mask)
    if dynamic_batch:
        # Traced with an unknown batch size, as Keras does after a batch of
        # another size.
        run = run.get_concrete_function(*tf.nest.map_structure(
            lambda t: t if t is None
            else tf.TensorSpec([None, *t.shape[1:]], t.dtype), args
        ))
    return run(*args)


class GhostLockstepMixin:
    """`assert_lockstep` and `assert_kinds` for `absltest.TestCase`s."""

    def assert_lockstep(self, model, x, y, loss=MSE, sample_weight=None,
                        mask=None, jit=False, clip=None, dynamic_batch=False):
        """Ghost == explicit clipping, with about half the examples clipped.

        Returns the ghost norms.
        """
        if compat.compile_loss(model) is None:
            model.compile(loss=loss)
        x = tf.nest.map_structure(tf.convert_to_tensor, x)
        y = tf.convert_to_tensor(y)
        if sample_weight is not None:
            sample_weight = tf.convert_to_tensor(sample_weight)
        grads, losses = reference_per_example_gradients(
            model, loss, x, y, sample_weight
        )
        norms = dp_math.per_example_global_norms(grads).numpy()
        if clip is None:
            # Clip roughly half of the examples and leave the others alone.
            clip = float(np.median(norms)) * 1.0001
        self.assertGreater(np.sum(norms > clip), 0)
        self.assertGreater(np.sum(norms < clip), 0)
        expected, _ = clipping.clip_and_sum(grads, clip, mask=mask)
        if mask is not None:
            mask = tf.convert_to_tensor(mask, "float32")
        summed, ghost_norms, ghost_losses, y_pred = ghost_clipped_sum(
            model, x, y, sample_weight, clip, mask, jit, dynamic_batch
        )
        np.testing.assert_allclose(ghost_norms, norms, rtol=2e-5, atol=1e-6)
        np.testing.assert_allclose(ghost_losses, losses, rtol=2e-5, atol=1e-6)
        self.assertEqual(len(summed), len(model.trainable_variables))
        scale = max(float(np.max(np.abs(e))) for e in expected)
        for variable, got, want in zip(
            model.trainable_variables, summed, expected
        ):
            self.assertEqual(tuple(got.shape), tuple(variable.shape))
            np.testing.assert_allclose(
                got, want, rtol=5e-5, atol=5e-6 * scale, err_msg=variable.path
            )
        self.assertEqual(
            tuple(y_pred.shape), tuple(model(x, training=False).shape)
        )
        return ghost_norms

    def assert_kinds(self, model, **expected):
        """`describe(model)[name]` starts with each expected kind."""
    
        described = ghost_clipping.describe(model)
        for name, kind in expected.items():
            self.assertTrue(
                described[name].startswith(kind), (name, described[name])
            )


# The diagnostics.

def hand_made_snapshot():
    """v^p = v^c + Phi exactly, m^p = m^c (Phi = 0.5, gamma' = 0.01).

    The corrected update is then the clean one, and the biased one is the
    clean one shrunk by sqrt(v / (v + Phi)).
    """
    m = np.array([1.0, -2.0, 3.0, -4.0])
    v = np.array([1.0, 4.0, 9.0, 16.0])
    return moments.MomentSnapshot(
        step=3, phi=0.5, gamma=0.01, noise_phi=0.5, beta_1=0.9, beta_2=0.999,
        m_clean=m, v_clean=v, m_private=m.copy(), v_private=v + 0.5,
    )


def reference_dpsgd_step(test, model, loss, x, y):
    """`(clip, want)`: C at the median per-example norm (about half of the
    examples clipped, checked) and the update of one noise-free DP-SGD
    step with learning rate 1 and B the batch size, from brute-force
    per-example gradients, one array per trainable variable."""
    grads, _ = reference_per_example_gradients(model, loss, x, y)
    norms = dp_math.per_example_global_norms(grads).numpy()
    clip = float(np.median(norms)) * 1.0001
    test.assertGreater(np.sum(norms > clip), 0)
    test.assertGreater(np.sum(norms < clip), 0)
    summed, _ = clipping.clip_and_sum(grads, clip)
    return clip, [-s.numpy() / len(norms) for s in summed]


def random_bert_batch(rng, length, batch=BATCH, vocabulary=30):
    """`(x, y)`: a BERT token dict of `batch` random sequences of `length`
    with 2 to `length` real tokens each (the rest padding), and binary
    labels; int32 tensors."""
    padding = (np.arange(length)
               < rng.integers(2, length + 1, size=batch)[:, None])
    x = {"token_ids": rng.integers(1, vocabulary, size=(batch, length))
         * padding,
         "segment_ids": np.zeros((batch, length)),
         "padding_mask": padding}
    x = {k: tf.constant(v, "int32") for k, v in x.items()}
    return x, tf.constant(rng.integers(0, 2, size=batch))


def noise_free_dpsgd_step(model, loss, clip, x, y, clipping="auto",
                          check_independence=True):
    """`make_private(model)` after one DP-SGD step on `(x, y)` with C =
    `clip`, no noise, learning rate 1 and B = the batch (the step that
    `reference_dpsgd_step` computes by brute force); `check_independence`
    as `make_private`'s (False: the step alone, without the guard's probes
    to trace)."""
    private = tf_dpadam.make_private(model, clipping=clipping,
                                     check_independence=check_independence)
    private.compile(
        optimizer=tf_dpadam.DPSGD(
            l2_norm_clip=clip, noise_multiplier=0.0, learning_rate=1.0,
            batch_size=int(y.shape[0])),
        loss=loss)
    private.train_on_batch(x, y)
    return private


def assert_update(variables, before, want):
    """The variables moved from `before` by `want` (float tolerance)."""
    scale = max(float(np.max(np.abs(w))) for w in want)
    for v, b, w in zip(variables, before, want):
        np.testing.assert_allclose(v.numpy() - b, w, rtol=1e-4,
                                   atol=1e-5 * scale, err_msg=v.path)


def tiny_lora_bert(length, output="pooled_output", seed=0):
    """A 1-block keras-hub BERT (width 8, vocabulary 30, no dropout) with
    `backbone.enable_lora(2)` and a Dense head on `output`
    ("pooled_output", or "cls": the final [CLS] state)."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=30, num_layers=1, num_heads=2, hidden_dim=8,
        intermediate_dim=16, max_sequence_length=length, dropout=0.0)
    backbone.enable_lora(2)
    names = ("token_ids", "segment_ids", "padding_mask")
    inputs = {n: keras.Input((length,), dtype="int32", name=n)
              for n in names}
    outputs = backbone(inputs)
    features = (outputs["sequence_output"][:, 0] if output == "cls"
                else outputs[output])
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(features))


# A tiny BERT WordPiece vocabulary: the special tokens and a few English
# words, so that ordinary sentences tokenize into more than [UNK].
TINY_VOCABULARY = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + (
    "the a an and or of to in is was it this that movie film good bad great "
    "awful not very fun boring story man woman dog cat sits runs plays "
    "outside inside animal person ##s ##ing ##ed . , ! ?"
).split()


def tiny_bert_classifier(seed=0):
    """A keras-hub `BertTextClassifier` of raw strings, 2 classes: a random
    1-block BERT (width 16, 2 heads, no dropout) and its preprocessor on
    `TINY_VOCABULARY` (8 tokens per sentence); seeded."""
    import keras_hub

    keras.utils.set_random_seed(seed)
    tokenizer = keras_hub.models.BertTokenizer(
        vocabulary=list(TINY_VOCABULARY), lowercase=True)
    preprocessor = keras_hub.models.BertTextClassifierPreprocessor(
        tokenizer, sequence_length=8)
    backbone = keras_hub.models.BertBackbone(
        vocabulary_size=len(TINY_VOCABULARY), num_layers=1, num_heads=2,
        hidden_dim=16, intermediate_dim=32, dropout=0.0,
        max_sequence_length=8)
    return keras_hub.models.BertTextClassifier(
        backbone, 2, preprocessor=preprocessor, dropout=0.0)
