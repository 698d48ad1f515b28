"""`vectorized_map`: `tf.vectorized_map` without a wrong oneDNN batch matmul.

Every per-example computation of this package (the vectorized path, the
per-layer fallback of ghost clipping, the mapped per-example loss) runs a
one-example function (batch axis of size 1) under `tf.vectorized_map`. Its
vectorizer (pfor) turns a `BatchMatMulV2` of a per-example `[1, M, K]` by a
shared `[K, P]` weight into one `BatchMatMulV2` of `[N, 1, M, K]` by
`[1, 1, K, P]`. TensorFlow 2.21's oneDNN kernel (on by default on x86 CPUs)
computes exactly this broadcast wrongly, or corrupts memory
("free(): invalid pointer"), while `[N, M, K]` by `[K, P]` and equal batch
shapes are right:

    tf.matmul(a, b)   # a: [12, 1, 5, 6], b: [6, 4]: max error 6.9 (eager: 3e32)

Keras' `EinsumDense.call` with LoRA (`einsum(x, lora_a) @ lora_b`) is such
a product, so per-example gradients of a LoRA `EinsumDense` on sequences
were wrong by 23% to 70% (and whatever else makes that product). The
converters below never emit a broadcasting batch matmul: a product with a
shared matrix is one 2-D `MatMul` of the flattened per-example operand (also
faster), and any other broadcast is made explicit before a 3-D batch matmul
of equal batch sizes. The change is exact and applies only inside this
module's `vectorized_map` (TensorFlow's registry is restored afterwards).

The converters live in a private registry of TensorFlow. So that the fix can
never switch off unnoticed, the first `vectorized_map` of the process runs a
known-answer check (`known_answer_problem`): products of small integer
matrices, exact in float32, of the broadcast shapes above, vectorized with
the converters installed, eagerly and in a `tf.function`, against products
computed in plain Python, and the converters must have been called. If the
registry could not be imported or the check fails, every `vectorized_map`
of the process runs as a `tf.map_fn` loop over the examples instead (exact,
slower; one warning says why): never wrong numbers.
"""

import contextlib
import threading
import warnings

import tensorflow as tf

from tf_dpadam.common import compat

# TensorFlow internals: the vectorizer's converter registry (None if it
# could not be imported; checked: see `known_answer_problem`).
_REGISTRY, _wrap = compat.pfor_converter_registry()

_LOCK = threading.RLock()
# How many batch matmuls this module's converter has vectorized (the check
# reads it to see that TensorFlow's vectorizer really called it).
_CONVERSIONS = [0]
# The cached outcome of the known-answer check: [] before it ran, then
# [None] (exact) or [why not].
_KNOWN_ANSWER = []

LOOP_WARNING = (
    "tf_dpadam cannot vectorize the per-example computations exactly ({why})."
    " TensorFlow 2.21's oneDNN batch matmul is wrong for the broadcasts that"
    " tf.vectorized_map makes, so every per-example map of this process runs"
    " as a tf.map_fn loop over the examples instead: exact, but slower."
)


def _shared_matrix(t):
    """`t` as a 2-D matrix if all its batch dimensions are statically 1."""
    rank = t.shape.rank
    if rank is None or rank < 2:
        return None
    if any(d != 1 for d in t.shape[:-2]):
        return None
    return tf.reshape(t, tf.shape(t)[-2:])


def _expand_after_loop(t, count):
    """Inserts `count` size-1 axes after the loop axis of a stacked `t`."""
    for _ in range(count):
        t = tf.expand_dims(t, 1)
    return t


def _times_shared(stacked, matrix, extra_axes):
    """`stacked @ matrix` for a stacked `[N, ..., M, K]` and a `[K, P]`."""
    shape = tf.shape(stacked)
    flat = tf.reshape(stacked, [-1, shape[-1]])
    out = tf.matmul(flat, matrix)
    out = tf.reshape(out, tf.concat([shape[:-1], tf.shape(matrix)[-1:]], 0))
    return _expand_after_loop(out, extra_axes)


def _swap_last(t):
    rank = t.shape.rank
    return tf.transpose(t, list(range(rank - 2)) + [rank - 1, rank - 2])


def _explicit_broadcast_matmul(x, x_stacked, y, y_stacked, loop_len):
    """`x @ y` over the loop with every broadcast made explicit."""
    ranks = [t.shape.rank - (1 if s else 0)
             for t, s in ((x, x_stacked), (y, y_stacked))]
    rank = max(ranks)
    aligned = []
    for t, stacked, r in ((x, x_stacked, ranks[0]), (y, y_stacked, ranks[1])):
        if stacked:
            t = _expand_after_loop(t, rank - r)
        else:
            t = tf.reshape(t, tf.concat(
                [tf.ones([1 + rank - r], tf.int32), tf.shape(t)], 0
            ))
        aligned.append(t)
    x, y = aligned
    batch = tf.broadcast_dynamic_shape(tf.shape(x)[:-2], tf.shape(y)[:-2])
    batch = tf.concat([tf.reshape(loop_len, [1]), batch[1:]], 0)
    x = tf.broadcast_to(x, tf.concat([batch, tf.shape(x)[-2:]], 0))
    y = tf.broadcast_to(y, tf.concat([batch, tf.shape(y)[-2:]], 0))
    m, k = tf.shape(x)[-2], tf.shape(x)[-1]
    p = tf.shape(y)[-1]
    out = tf.matmul(tf.reshape(x, [-1, m, k]), tf.reshape(y, [-1, k, p]))
    return tf.reshape(out, tf.concat([batch, [m, p]], 0))


def _convert_batch_matmul(pfor_input):
    """Converter of `BatchMatMulV2` for the vectorizer."""
    _CONVERSIONS[0] += 1
    x, x_stacked, _ = pfor_input.input(0)
    y, y_stacked, _ = pfor_input.input(1)
    if x.shape.rank is None or y.shape.rank is None:
        raise ValueError(
            "tf_dpadam cannot vectorize a batch matmul of unknown rank"
            " exactly (TensorFlow 2.21's oneDNN kernel is wrong for some"
            " broadcasts); give the layer inputs of known rank."
        )
    if pfor_input.get_attr("adj_x"):
        x = tf.linalg.adjoint(x)
    if pfor_input.get_attr("adj_y"):
        y = tf.linalg.adjoint(y)
    rank_x = x.shape.rank - (1 if x_stacked else 0)
    rank_y = y.shape.rank - (1 if y_stacked else 0)
    if x_stacked and not y_stacked:
        matrix = _shared_matrix(y)
        if matrix is not None:
            return _wrap(_times_shared(x, matrix, max(0, rank_y - rank_x)),
                         True)
    if y_stacked and not x_stacked:
        matrix = _shared_matrix(x)
        if matrix is not None:
            # x @ y = (y^T @ x^T)^T.
            out = _times_shared(_swap_last(y), tf.transpose(matrix),
                                max(0, rank_x - rank_y))
            return _wrap(_swap_last(out), True)
    out = _explicit_broadcast_matmul(
        x, x_stacked, y, y_stacked, pfor_input.pfor.loop_len_vector
    )
    return _wrap(out, True)


# TensorFlow's converter of the older `BatchMatMul` (no broadcasting) already
# stacks both operands to equal batch sizes.
_CONVERTERS = {"BatchMatMulV2": _convert_batch_matmul}


@contextlib.contextmanager
def exact_converters():
    """Installs this module's converters in the vectorizer, then restores.

    Without the registry it installs nothing; `vectorized_map` then never
    vectorizes (`known_answer_problem`).
    """
    if _REGISTRY is None:
        yield
        return
    with _LOCK:
        saved = {name: _REGISTRY.get(name) for name in _CONVERTERS}
        _REGISTRY.update(_CONVERTERS)
        try:
            yield
        finally:
            for name, converter in saved.items():
                if converter is None:
                    _REGISTRY.pop(name, None)
                else:
                    _REGISTRY[name] = converter


def _matrix(rows, cols, seed):
    """A small integer matrix (a list of lists), different for each seed."""
    return [[(seed * 7 + r * 3 + c * 5) % 7 - 3 for c in range(cols)]
            for r in range(rows)]


def _python_matmul(a, b):
    return [[sum(a[i][k] * b[k][j] for k in range(len(b)))
             for j in range(len(b[0]))] for i in range(len(a))]


@tf.autograph.experimental.do_not_convert
def _check_broadcast_products():
    """The known-answer check; None if exact, else why not (a string).

    Per example i: `x_i[None] @ w` ([1, 5, 6] by a shared [6, 4], the shape
    oneDNN gets wrong) and `v @ x_i[None]` ([3, 5] by [1, 5, 6]). Integers
    below 4 in magnitude: every product is exact in float32.
    """
    if _REGISTRY is None:
        return ("TensorFlow's vectorizer converter registry"
                " `tensorflow.python.ops.parallel_for.pfor."
                "_pfor_converter_registry` could not be imported")
    examples = [_matrix(5, 6, i) for i in range(12)]
    w, v = _matrix(6, 4, 100), _matrix(3, 5, 200)
    want = (tf.constant([_python_matmul(x, w) for x in examples], "float32"),
            tf.constant([_python_matmul(v, x) for x in examples], "float32"))
    x = tf.constant(examples, "float32")
    w, v = tf.constant(w, "float32"), tf.constant(v, "float32")

    def one(example):
        return (tf.matmul(example[None], w)[0],
                tf.matmul(v, example[None])[0])

    def mapped(elems):
        with exact_converters():
            return tf.vectorized_map(one, elems)

    for mode, run in (("eagerly", mapped),
                      ("in a tf.function", tf.function(mapped))):
        before = _CONVERSIONS[0]
        got = run(x)
        if _CONVERSIONS[0] == before:
            return (f"TensorFlow's vectorizer did not call tf_dpadam's batch"
                    f" matmul converter ({mode})")
        for g, e in zip(got, want):
            error = float(tf.reduce_max(tf.abs(g - e)))
            if not error == 0.0:  # Also catches NaN.
                return (f"a known-answer check of the vectorized broadcast"
                        f" product was off by {error} ({mode})")
    return None


@tf.autograph.experimental.do_not_convert
def known_answer_problem():
    """Why this process cannot use the exact vectorizer, or None if it can.

    Runs the known-answer check once per process (outside any graph being
    traced), then returns the cached outcome; the first problem found
    warns once.
    """
    with _LOCK:
        if not _KNOWN_ANSWER:
            try:
                with tf.init_scope():
                    problem = _check_broadcast_products()
            except Exception as error:  # pylint: disable=broad-except
                problem = (f"the known-answer check raised"
                           f" {type(error).__name__}: {str(error)[:300]}")
            _KNOWN_ANSWER.append(problem)
            if problem is not None:
                warnings.warn(LOOP_WARNING.format(why=problem), stacklevel=3)
        return _KNOWN_ANSWER[0]


def _loop_map(fn, elems):
    """`fn` over the examples by `tf.map_fn` (a while loop): no vectorizer."""
    elems = tf.nest.map_structure(tf.convert_to_tensor, elems)
    spec = tf.nest.map_structure(
        lambda t: tf.TensorSpec(t.shape[1:], t.dtype), elems)
    # The output signature, from a trace of `fn` on one example (no run).
    outputs = tf.function(fn, autograph=False).get_concrete_function(
        spec).structured_outputs
    signature = tf.nest.map_structure(
        lambda t: tf.TensorSpec(t.shape, t.dtype), outputs)
    return tf.map_fn(fn, elems, fn_output_signature=signature)


def vectorized_map(fn, elems, what="the per-example gradients"):
    """`tf.vectorized_map(fn, elems, fallback_to_while_loop=True)`, exact.

    The same as TensorFlow's, with batch matrix products vectorized without
    the broadcasts that TensorFlow 2.21's oneDNN kernel gets wrong (see the
    module docstring). If this process failed the known-answer check
    (`known_answer_problem`), a `tf.map_fn` loop over the examples instead.

    Raises:
        ValueError: naming `what`, if TensorFlow cannot vectorize `fn` (e.g.
            a `tf.while_loop` whose state TensorFlow's vectorizer does not
            convert, as in an RNN that is not unrolled after an Embedding).
    """
    if known_answer_problem() is not None:
        return _loop_map(fn, elems)
    with exact_converters():
        try:
            return tf.vectorized_map(fn, elems, fallback_to_while_loop=True)
        except (TypeError, NotImplementedError) as error:
            raise ValueError(
                f"TensorFlow cannot vectorize {what} over the examples"
                f" ({type(error).__name__}: {str(error)[:500]}). Use"
                " make_private(clipping='auto') (ghost clipping maps only the"
                " layers it has no rule for), or make the loop static (e.g."
                " `unroll=True` in RNN layers)."
            ) from error
