"""keras-hub task models (with their preprocessor) through `make_private`.

A keras-hub task such as `keras_hub.models.BertTextClassifier(backbone,
num_classes, preprocessor=preprocessor)` takes raw strings in `fit`,
`evaluate` and `predict`: its `PipelineModel` base maps
`preprocess_samples` over the batches of the input pipeline, and the model
itself only ever sees token ids. The private model keeps that contract: when
the wrapped model has `preprocess_samples`, `PreprocessingMixin` maps it over
the data the same way (in `tf.data`, batch by batch, outside the train
step), so the per-example gradients are those of the preprocessed examples.

That is exact for DP as long as preprocessing treats each example on its own
(a tokenizer padding or cutting every example to a fixed length does); the
noise, clipping and accounting are unchanged. Poisson batches from
`tf_dpadam.data.poisson_batches` work on raw strings: their padding rows are
empty strings of sample weight 0, which contribute nothing.

`map_each_example` is the row-wise map behind `PoissonBatches.map_examples`:
a user's function on one example at a time, the weights carried through.
"""

import keras
import numpy as np
import tensorflow as tf

# The way out for a keras-hub task model's data that tf.data cannot batch.
_PREPROCESSOR_HINT = (
    " A private model with a keras-hub preprocessor preprocesses its data in"
    " tf.data: preprocess it yourself (`model.preprocessor(x, y)` in your"
    " pipeline) and pass the token ids, or pass one of the above."
)

# What `fit` and friends accept as data for a model with a preprocessor, and
# `per_example_gradient_norms` for any private model.
SUPPORTED_INPUTS = (
    "NumPy arrays, lists or tensors (with `y`, `sample_weight` and"
    " `batch_size`), or a `tf.data.Dataset` of raw batches (for DP, e.g."
    " `tf_dpadam.data.poisson_batches(...).dataset`)"
)


def preprocessor_of(model):
    """The `preprocess_samples` of a keras-hub task model, else None."""
    preprocess = getattr(model, "preprocess_samples", None)
    if preprocess is None or getattr(model, "preprocessor", None) is None:
        return None
    return preprocess


def _preprocess_element(preprocess, *element):
    """`preprocess(x, y, sample_weight)` on one batch of a dataset."""
    x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(element)
    return preprocess(x, y, sample_weight)


def map_preprocessing(dataset, preprocess):
    """`dataset`'s batches, preprocessed in parallel, with prefetching."""
    return dataset.map(
        lambda *element: _preprocess_element(preprocess, *element),
        num_parallel_calls=tf.data.AUTOTUNE,
    ).prefetch(tf.data.AUTOTUNE)


def map_each_example(dataset, fn):
    """`fn(x, y) -> (x, y)` on each example of `(x, y, sample_weight)` batches.

    Row-wise by construction: `tf.map_fn` calls `fn` on one example at a
    time (padding rows included), so an output row depends on its own input
    row only, and the sample weights pass through untouched (an absent row,
    of weight 0, stays absent). The batches keep their order and sizes; the
    batches run in parallel, each at about the cost of `unbatch().map(fn)
    .batch(b)` (0.2 ms a 28x28 example for a flip on 2 busy cores).

    Raises:
        ValueError: if `fn` does not return a pair `(x, y)`.
    """
    def pair(x, y):
        out = fn(x, y)
        if not isinstance(out, (tuple, list)) or len(out) != 2:
            raise ValueError(
                "Expected fn(x, y) to return a pair (x, y): the sample"
                " weights are carried through, not given to fn; got"
                f" {type(out).__name__}. Put per-example weights in the"
                " data (poisson_batches((x, y, sample_weight), ...)).")
        return tuple(out)

    # One example's spec out of `fn` (tf.data traces it on one row).
    spec = dataset.unbatch().map(lambda x, y, w: pair(x, y)).element_spec

    def each_example(x, y, w):
        x, y = tf.map_fn(lambda row: pair(*row), (x, y),
                         fn_output_signature=spec)
        return x, y, w

    return dataset.map(each_example, num_parallel_calls=tf.data.AUTOTUNE,
                       deterministic=True).prefetch(tf.data.AUTOTUNE)


def as_rows(value, *, numpy_leaves=False):
    """`value` as rows that `tf.data` or NumPy slicing splits by example.

    A list of rows (numbers, strings, nested lists) becomes one array, not
    one leaf per row; dicts and tuples are converted value by value; None
    stays None.

    Args:
        value: arrays, tensors or lists, or dicts / tuples of them, or None.
        numpy_leaves: False (the preprocessing of a keras-hub task): tensors
            stay tensors and every list becomes one array. True (`fit`'s
            Poisson sampling, which gathers rows in NumPy): every leaf
            becomes a NumPy array, and a list of arrays or tensors (the
            inputs of a multi-input model) stays a list of them.
    """
    if value is None:
        return None
    if numpy_leaves:
        if isinstance(value, list) and not any(
                isinstance(v, (np.ndarray, tf.Tensor, list, dict))
                for v in value):
            return np.asarray(value)  # a list of rows (numbers, strings)
        return keras.tree.map_structure(np.asarray, value)
    if isinstance(value, list):
        return np.asarray(value)
    if isinstance(value, dict):
        return {key: as_rows(item) for key, item in value.items()}
    if isinstance(value, tuple):
        return tuple(as_rows(item) for item in value)
    return value


def num_rows(rows):
    """The number of examples of `rows` (the length of its first leaf)."""
    return len(tf.nest.flatten(rows)[0])


def split_rows(rows, start, end):
    """Rows `start:end` of every leaf of `rows` (None stays None)."""
    return tf.nest.map_structure(
        lambda v: None if v is None else v[start:end], rows)


def batched(x, y=None, sample_weight=None, batch_size=None, shuffle=False,
            argument="x", hint=""):
    """`(x, y, sample_weight)` as a dataset of batches of raw examples.

    A `tf.data.Dataset` passes through unchanged (then `y`, `sample_weight`
    and `batch_size` must be None, as in Keras). Arrays are batched by
    `batch_size` (default 32), reshuffled at every pass when `shuffle`, the
    way `keras.Model.fit` treats arrays.

    Raises:
        ValueError: for inputs that cannot be batched in `tf.data` (Python
            generators, `keras.utils.PyDataset`), naming `argument`, with
            `hint` (what the caller's user can do instead) appended.
    """
    if isinstance(x, tf.data.Dataset):
        for name, value in (("y", y), ("sample_weight", sample_weight),
                            ("batch_size", batch_size)):
            if value is not None:
                raise ValueError(
                    f"When {argument} is a tf.data.Dataset, expected"
                    f" {name}=None (the dataset yields its batches); got"
                    f" {name}={value!r}."
                )
        return x
    if x is None or isinstance(x, keras.utils.PyDataset) or (
            hasattr(x, "__next__")):
        raise ValueError(
            f"Expected {argument} to be {SUPPORTED_INPUTS}, got"
            f" {type(x).__name__}.{hint}"
        )
    data = keras.utils.pack_x_y_sample_weight(
        as_rows(x), as_rows(y), as_rows(sample_weight))
    dataset = tf.data.Dataset.from_tensor_slices(data)
    if shuffle:
        dataset = dataset.shuffle(int(dataset.cardinality()),
                                  reshuffle_each_iteration=True)
    return dataset.batch(batch_size or 32)


class PreprocessingMixin:
    """`fit`, `evaluate` and `predict` that apply a task's preprocessor.

    Mixed into `PrivateModel` (whose wrapped model is `self.base_model`).
    For a wrapped model without a preprocessor, every method is Keras' own.
    """

    def _preprocessor(self):
        return preprocessor_of(self.base_model)

    @staticmethod
    def _batched(*args, **kwargs):
        return batched(*args, hint=_PREPROCESSOR_HINT, **kwargs)

    def fit(self, x=None, y=None, batch_size=None, epochs=1,
            sample_weight=None, validation_split=0.0, validation_data=None,
            shuffle=True, **kwargs):
        preprocess = self._preprocessor()
        if preprocess is None:
            return super().fit(
                x, y, batch_size=batch_size, epochs=epochs,
                sample_weight=sample_weight,
                validation_split=validation_split,
                validation_data=validation_data, shuffle=shuffle, **kwargs)
        if validation_split:
            if validation_data is not None or isinstance(x, tf.data.Dataset):
                given = ("validation_data" if validation_data is not None
                         else "a dataset")
                raise ValueError(
                    "validation_split needs arrays and no validation_data;"
                    f" got validation_split={validation_split!r} with"
                    f" {given}."
                )
            data = (as_rows(x), as_rows(y), as_rows(sample_weight))
            rows = num_rows(data[0])
            cut = int(rows * (1.0 - validation_split))
            validation_data = split_rows(data, cut, rows)
            x, y, sample_weight = split_rows(data, 0, cut)
        train = map_preprocessing(
            self._batched(x, y, sample_weight, batch_size, shuffle=shuffle),
            preprocess)
        if validation_data is not None:
            if not isinstance(validation_data, tf.data.Dataset):
                validation_data = self._batched(
                    *keras.utils.unpack_x_y_sample_weight(
                        tuple(validation_data)),
                    batch_size=kwargs.get("validation_batch_size")
                    or batch_size, argument="validation_data")
            validation_data = map_preprocessing(validation_data, preprocess)
        kwargs.pop("validation_batch_size", None)
        # Shuffled above (arrays) or by the dataset's maker.
        return super().fit(train, epochs=epochs,
                           validation_data=validation_data, shuffle=False,
                           **kwargs)

    def evaluate(self, x=None, y=None, batch_size=None, sample_weight=None,
                 **kwargs):
        preprocess = self._preprocessor()
        if preprocess is None or kwargs.get("_use_cached_eval_dataset"):
            # Keras' fit evaluates on the (already preprocessed) data it
            # was given through this flag.
            return super().evaluate(x, y, batch_size=batch_size,
                                    sample_weight=sample_weight, **kwargs)
        data = map_preprocessing(
            self._batched(x, y, sample_weight, batch_size), preprocess)
        return super().evaluate(data, **kwargs)

    def predict(self, x, batch_size=None, **kwargs):
        preprocess = self._preprocessor()
        if preprocess is None:
            return super().predict(x, batch_size=batch_size, **kwargs)
        data = map_preprocessing(self._batched(x, batch_size=batch_size),
                                 preprocess)
        return super().predict(data, **kwargs)

    def _preprocessed_batch(self, x, y=None, sample_weight=None):
        preprocess = self._preprocessor()
        if preprocess is None:
            return x, y, sample_weight
        return keras.utils.unpack_x_y_sample_weight(
            preprocess(as_rows(x), as_rows(y), as_rows(sample_weight)))

    def train_on_batch(self, x, y=None, sample_weight=None, **kwargs):
        x, y, sample_weight = self._preprocessed_batch(x, y, sample_weight)
        return super().train_on_batch(x, y, sample_weight=sample_weight,
                                      **kwargs)

    def test_on_batch(self, x, y=None, sample_weight=None, **kwargs):
        x, y, sample_weight = self._preprocessed_batch(x, y, sample_weight)
        return super().test_on_batch(x, y, sample_weight=sample_weight,
                                     **kwargs)

    def predict_on_batch(self, x):
        x, _, _ = self._preprocessed_batch(x)
        return super().predict_on_batch(x)
