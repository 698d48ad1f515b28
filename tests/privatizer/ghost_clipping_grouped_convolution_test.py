"""Grouped convolutions (`groups > 1`) take ghost clipping, exactly.

A grouped convolution is `groups` independent convolutions on the channel
slices, so its per-example norms and clipped sum are theirs. Checked against
brute force: every example's gradient from a one-example `tf.GradientTape`
of a float64 copy of the model (each grouped convolution computed as its
groups' convolutions), clipped to C and summed in NumPy, against the clean
gradient of one noise-free `make_private(..., clipping="ghost")` step. The
float64 copy is itself checked against the Keras model's own tapes with
oneDNN on (the suite's setting, `tests/conftest.py`); a child process runs
the same comparisons with `TF_ENABLE_ONEDNN_OPTS=0`, where TensorFlow 2.21
has no gradient of a grouped convolution (the private step used to fail
there with an `InvalidArgumentError`).
"""

import json
import os
import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from absl.testing import absltest
from absl.testing import parameterized

from tf_dpadam.privatizer import ghost_clipping

import helpers
import sensitivity

LOSS = keras.losses.MeanSquaredError()
ONEDNN_OFF = os.environ.get("TF_ENABLE_ONEDNN_OPTS") == "0"

# name -> (layer class, input shape, keyword arguments of the grouped layer).
CASES = {
    "conv2d_groups2": (keras.layers.Conv2D, (6, 5, 4), dict(
        filters=4, kernel_size=3, groups=2, padding="same")),
    "conv2d_groups4_strided_valid": (keras.layers.Conv2D, (7, 6, 4), dict(
        filters=8, kernel_size=(3, 2), groups=4, strides=2)),
    "conv2d_groups2_dilated_no_bias": (keras.layers.Conv2D, (7, 7, 4), dict(
        filters=6, kernel_size=3, groups=2, dilation_rate=2, padding="same",
        use_bias=False)),
    # 5 channels a group: patches from slices, not the identity convolution.
    "conv2d_groups2_wide": (keras.layers.Conv2D, (5, 5, 10), dict(
        filters=4, kernel_size=2, groups=2)),
    "conv1d_groups2_causal": (keras.layers.Conv1D, (9, 4), dict(
        filters=6, kernel_size=3, groups=2, padding="causal",
        dilation_rate=2)),
    "conv1d_groups4_strided": (keras.layers.Conv1D, (9, 8), dict(
        filters=4, kernel_size=2, groups=4, strides=2)),
}


def _model(case):
    """A 1x1 convolution (so the step differentiates through the grouped
    one to its input), the grouped convolution (tanh), a Dense head."""
    cls, shape, kwargs = CASES[case]
    return helpers.sequential(
        shape, cls(shape[-1], 1, name="pre"),
        cls(activation="tanh", name="grouped", **kwargs),
        keras.layers.Flatten(), keras.layers.Dense(3, name="head"))


def _data(case, rows=6):
    shape = CASES[case][1]
    return (helpers.normal((rows, *shape)).astype("float64"),
            helpers.normal((rows, 3), seed=1).astype("float64"))


def _convolve(h, kernel, layer):
    """`layer`'s convolution of `h` as its groups' convolutions."""
    padding = layer.padding.upper()
    if padding == "CAUSAL":
        left = (layer.kernel_size[0] - 1) * layer.dilation_rate[0]
        h, padding = tf.pad(h, [[0, 0], [left, 0], [0, 0]]), "VALID"
    return tf.concat([
        tf.nn.convolution(a, k, strides=layer.strides, padding=padding,
                          dilations=layer.dilation_rate)
        for a, k in zip(tf.split(h, layer.groups, axis=-1),
                        tf.split(kernel, layer.groups, axis=-1))], axis=-1)


def _forward(model, weights, x):
    """The model's output at `weights` (its trainable variables' values),
    in float64, without Keras' convolutions."""
    values, h = iter(weights), tf.constant(x, "float64")
    for layer in model.layers:
        if isinstance(layer, keras.layers.Flatten):
            h = tf.reshape(h, [h.shape[0], -1])
            continue
        kernel = next(values)
        h = (h @ kernel if isinstance(layer, keras.layers.Dense)
             else _convolve(h, kernel, layer))
        if layer.use_bias:
            h = h + next(values)
        h = tf.tanh(h) if layer.activation is keras.activations.tanh else h
    return h


def _values(model):
    return [np.asarray(keras.ops.convert_to_numpy(v), "float64")
            for v in model.trainable_variables]


def reference_gradients(model, x, y, group_size=1, shifts=None,
                        shift_weight=0.0):
    """Each example's gradient (float64 arrays, one list per example) from
    one-example tapes; an example is `group_size` rows (its loss their
    mean); with `shifts`, (1 - w) grad(theta) + w grad(theta + d)."""
    points = [(1.0 - shift_weight, _values(model))]
    if shifts is not None:
        points.append((shift_weight, [v + d for v, d in
                                      zip(points[0][1], shifts)]))
    grads = []
    for start in range(0, len(x), group_size):
        rows = slice(start, start + group_size)
        total = 0.0
        for weight, values in points:
            weights = [tf.constant(v) for v in values]
            with tf.GradientTape() as tape:
                tape.watch(weights)
                pred = _forward(model, weights, x[rows])
                loss = tf.reduce_mean(tf.square(pred - y[rows]))
            total = total + weight * np.concatenate([
                g.numpy().ravel() for g in tape.gradient(loss, weights)])
        grads.append(total)
    return _unflatten(np.array(grads), model)


def _unflatten(flat, model):
    """`[B, n]` as a list of `[B, *shape]` arrays, one per variable."""
    out, start = [], 0
    for v in model.trainable_variables:
        size = int(np.prod(v.shape))
        out.append(flat[:, start:start + size].reshape(-1, *v.shape))
        start += size
    return out


def keras_gradients(model, x, y):
    """The same from the Keras model's own tapes (float32)."""
    grads = []
    for i in range(len(x)):
        with tf.GradientTape() as tape:
            loss = LOSS(y[i:i + 1], model(x[i:i + 1].astype("float32")))
        grads.append(np.concatenate([
            g.numpy().ravel()
            for g in tape.gradient(loss, model.trainable_variables)]))
    return _unflatten(np.array(grads, "float64"), model)


def clip_and_sum(grads, clip, scales=None):
    """`(norms, clipped sum)` in float64 of `S * grad_i`."""
    if scales is not None:
        grads = [g * s for g, s in zip(grads, scales)]
    norms = np.sqrt(sum(np.sum(np.square(g.reshape(len(g), -1)), axis=1)
                        for g in grads))
    factors = np.minimum(1.0, clip / norms)
    return norms, [np.tensordot(factors, g, axes=1) for g in grads]


def errors(got, want):
    """`(max abs error, max abs error / max |want|)` over the arrays."""
    worst = max(float(np.max(np.abs(np.asarray(g, "float64") - w)))
                for g, w in zip(got, want))
    scale = max(float(np.max(np.abs(w))) for w in want)
    return worst, worst / scale


def private_step_errors(case, clipping="ghost"):
    """One noise-free private step of `case` against brute force: `{"sum":
    (abs, rel), "norms": (abs, rel), "path": describe's word}`, C at the
    median norm (about half of the examples clipped)."""
    model = _model(case)
    x, y = _data(case)
    grads = reference_gradients(model, x, y)
    norms, _ = clip_and_sum(grads, np.inf)
    clip = float(np.median(norms))
    _, want = clip_and_sum(grads, clip)
    private = sensitivity.private_probe(model, LOSS, clip, clipping=clipping)
    x32, y32 = x.astype("float32"), y.astype("float32")
    got = sensitivity.clipped_sum(private, x32, y32)
    got_norms, _ = private.per_example_norms_step((x32, y32))
    return {"sum": errors(got, want),
            "norms": errors([got_norms], [norms]),
            "path": ghost_clipping.describe(model)["grouped"]}


def clipped_sum_errors(case, option=None):
    """`ghost_clipping.clipped_gradient_sum` (the step's core, without a
    train step to trace) against brute force: `{"sum": (abs, rel),
    "norms": (abs, rel)}`; `option` adds augmentation multiplicity
    ("group_size", K = 2), scale-then-privatize's "scales" or DiSK's
    "shifts"."""
    model = _model(case)
    model.compile(loss=LOSS)
    x, y = _data(case)
    rng = helpers.rng(2)
    values = _values(model)
    kwargs, reference, scales = {}, {}, None
    if option == "group_size":
        kwargs = reference = {"group_size": 2}
    elif option == "scales":
        scales = [rng.uniform(0.5, 2.0, size=v.shape) for v in values]
        kwargs = {"scales": [tf.constant(s, "float32") for s in scales]}
    elif option == "shifts":
        shifts = [0.1 * rng.normal(size=v.shape) for v in values]
        reference = {"shifts": shifts, "shift_weight": 0.3}
        kwargs = {"shifts": [tf.constant(s, "float32") for s in shifts],
                  "shift_weight": 0.3}
    grads = reference_gradients(model, x, y, **reference)
    norms, _ = clip_and_sum(grads, np.inf, scales)
    clip = float(np.median(norms))
    _, want = clip_and_sum(grads, clip, scales)
    loss_fn = ghost_clipping.compiled_loss_fn(model)

    @tf.function
    def run(x, y):
        return ghost_clipping.clipped_gradient_sum(
            model, loss_fn, x, y, None, clip, **kwargs)

    got, got_norms, _, _ = run(tf.constant(x, "float32"),
                               tf.constant(y, "float32"))
    return {"sum": errors(got, want), "norms": errors([got_norms], [norms])}


def child_results():
    """What the child process reports: the checks of the tests, and
    whether TensorFlow itself could differentiate a grouped convolution."""
    try:
        kernel = tf.ones([2, 2, 2, 4])
        with tf.GradientTape() as tape:
            tape.watch(kernel)
            out = tf.nn.conv2d(tf.ones([1, 3, 3, 4]), kernel, 1, "SAME")
        tape.gradient(out, kernel).numpy()
        native = True
    except tf.errors.InvalidArgumentError:
        native = False
    return {"native_grouped_gradient": native,
            "steps": {f"{case} {clipping}": private_step_errors(case, clipping)
                      for case, clipping in STEPS},
            "sums": {f"{case} {option}": clipped_sum_errors(case, option)
                     for case, option in SUMS}}


# What the tests check, in this process and in the child: full private
# steps (each traces a train step, a few seconds), and the clipped sum of
# every case and option.
STEPS = [("conv2d_groups4_strided_valid", "ghost"),
         ("conv1d_groups2_causal", "ghost"), ("conv2d_groups2", "auto")]
SUMS = ([(case, None) for case in CASES]
        + [("conv2d_groups2", o) for o in ("group_size", "scales", "shifts")])


class GroupedConvolutionTest(parameterized.TestCase):

    def assert_exact(self, result):
        # float32 against a float64 reference.
        for what in ("sum", "norms"):
            self.assertLess(result[what][1], 2e-5, (what, result))

    @parameterized.named_parameters(
        (f"{case}_{clipping}", case, clipping) for case, clipping in STEPS)
    @pytest.mark.slow
    def test_private_step_matches_brute_force(self, case, clipping):
        result = private_step_errors(case, clipping)
        self.assertEqual(result["path"], "ghost (Conv)")
        self.assert_exact(result)

    @parameterized.named_parameters(
        (f"{case}_{option}" if option else case, case, option)
        for case, option in SUMS)
    def test_clipped_sum_matches_brute_force(self, case, option):
        self.assert_exact(clipped_sum_errors(case, option))

    @parameterized.named_parameters(
        ("conv2d", "conv2d_groups4_strided_valid"),
        ("conv1d", "conv1d_groups2_causal"))
    @pytest.mark.slow
    def test_reference_is_the_keras_model(self, case):
        if ONEDNN_OFF:
            self.skipTest("no grouped-convolution gradient without oneDNN")
        model = _model(case)
        x, y = _data(case)
        np.testing.assert_allclose(
            _forward(model, _values(model), x),
            model(x.astype("float32")), rtol=1e-5, atol=1e-6)
        for got, want in zip(keras_gradients(model, x, y),
                             reference_gradients(model, x, y)):
            np.testing.assert_allclose(got, want, rtol=1e-4,
                                       atol=1e-6 * np.max(np.abs(want)))

    @pytest.mark.slow
    def test_without_onednn(self):
        env = dict(os.environ, TF_ENABLE_ONEDNN_OPTS="0",
                   TF_CPP_MIN_LOG_LEVEL="2",
                   PYTHONPATH=os.pathsep.join(
                       p for p in (helpers.TESTS_DIR,
                                   os.environ.get("PYTHONPATH")) if p))
        run = subprocess.run([sys.executable, __file__, "onednn_off_child"],
                             capture_output=True, text=True, timeout=600,
                             check=False, env=env)
        lines = [l for l in run.stdout.splitlines() if l.startswith("RESULT ")]
        if run.returncode != 0 or not lines:
            raise AssertionError(f"The child process failed:\n{run.stderr}")
        result = json.loads(lines[-1][len("RESULT "):])
        # The premise: TensorFlow itself cannot differentiate it there.
        self.assertFalse(result["native_grouped_gradient"])
        self.assertLen(result["steps"], len(STEPS))
        self.assertLen(result["sums"], len(SUMS))
        for step in result["steps"].values():
            self.assertEqual(step["path"], "ghost (Conv)")
        for checked in [*result["steps"].values(), *result["sums"].values()]:
            self.assert_exact(checked)


if __name__ == "__main__":
    if sys.argv[1:] == ["onednn_off_child"]:
        print("RESULT " + json.dumps(child_results()))
    else:
        absltest.main()
