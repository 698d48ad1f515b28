"""Data for the harness's binaries: images, text, and small utilities.

Every helper takes its settings as parameters (no flags), returns NumPy
arrays (or a `tf.data.Dataset`) and prints nothing.

Images (`load_image_dataset`):

- `fashion_mnist`: Debian's `dataset-fashion-mnist` files (gzipped IDX, as
  published by Zalando) in `data_dir`, by default
  `/usr/share/datasets/fashion-mnist`; if they are absent,
  `tfds.load("fashion_mnist")`.
- `cifar10`: `tfds.load("cifar10")`.

`research.record_sources` reads a tensorflow-datasets dataset prepared in
the ArrayRecord format by random access (`--data_source`), for training sets
larger than memory.

A tensorflow-datasets dataset that is not prepared in `data_dir` and cannot
be downloaded (no network) raises `DatasetUnavailableError` at once, instead
of after tensorflow-datasets' minutes of retries.

Text (`load_text_dataset`):

- `sst2_tsv`: GLUE's SST-2 as `train.tsv` / `dev.tsv` in `data_dir`.
- `glue/sst2`: the same through tensorflow-datasets (train / validation).
- `snli`: premise / hypothesis pairs through tensorflow-datasets
  (train / test), without the examples of label -1 (no gold label).
"""

import contextlib
import csv
import gzip
import os
import socket
import urllib.parse

from absl import logging
import numpy as np
import tensorflow as tf

IMAGE_DATASETS = ("fashion_mnist", "cifar10")
TEXT_DATASETS = ("sst2_tsv", "glue/sst2", "snli")

# Where Debian's dataset-fashion-mnist package puts its files.
DEFAULT_FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"

# (train or test) -> (images file, labels file), without the ".gz".
FASHION_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}

# The IDX type byte -> big-endian NumPy dtype.
_IDX_DTYPES = {
    0x08: np.dtype("u1"),
    0x09: np.dtype("i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

_TFDS_BATCH = 4096

# With one of these set, downloads go through a proxy: a host that does not
# resolve here may still be reachable.
_PROXY_VARIABLES = ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy",
                    "ALL_PROXY", "all_proxy")


class DatasetUnavailableError(RuntimeError):
    """A tensorflow-datasets dataset that is neither prepared nor
    downloadable here (e.g. no network)."""


# --------------------------------------------------------------------------
# IDX files (MNIST, Fashion-MNIST).


def parse_idx(data):
    """Decodes the bytes of one IDX file into a NumPy array.

    IDX: two zero bytes, a type byte (0x08 = uint8, ...), a byte with the
    number of dimensions d, then d big-endian uint32 sizes, then the values
    in C order, big-endian.

    Raises:
        ValueError: if `data` is not a well-formed IDX file.
    """
    data = bytes(data)
    if len(data) < 4 or data[0] != 0 or data[1] != 0:
        raise ValueError("Not an IDX file: bad magic number.")
    type_code, ndim = data[2], data[3]
    if type_code not in _IDX_DTYPES:
        raise ValueError(f"Not an IDX file: unknown type byte {type_code:#x}.")
    header = 4 + 4 * ndim
    if len(data) < header:
        raise ValueError("Truncated IDX file: incomplete header.")
    shape = tuple(int(s) for s in np.frombuffer(data, ">u4", ndim, offset=4))
    dtype = _IDX_DTYPES[type_code]
    size = int(np.prod(shape, dtype=np.int64))
    if len(data) != header + size * dtype.itemsize:
        raise ValueError(
            f"IDX file of shape {shape} should have"
            f" {header + size * dtype.itemsize} bytes, has {len(data)}."
        )
    values = np.frombuffer(data, dtype, size, offset=header).reshape(shape)
    return values.astype(dtype.newbyteorder("="))


def read_idx(path):
    """Reads an IDX file, gzipped (by its content, not its name) or not."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return parse_idx(data)


def _find_file(folder, stem):
    """`folder/stem.gz` or `folder/stem`, whichever exists, else None."""
    for name in (stem + ".gz", stem):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            return path
    return None


def fashion_mnist_files(data_dir=None):
    """The four Fashion-MNIST IDX paths in `data_dir`, or None if one lacks.

    Returns:
        `{"train": (images, labels), "test": (images, labels)}` or None.
    """
    folder = data_dir or DEFAULT_FASHION_MNIST_DIR
    files = {}
    for split, stems in FASHION_MNIST_FILES.items():
        paths = tuple(_find_file(folder, stem) for stem in stems)
        if None in paths:
            return None
        files[split] = paths
    return files


def load_idx_images(images_path, labels_path):
    """`(x, y)`: float32 images in [0, 1], (N, H, W, 1), and int32 labels."""
    images = read_idx(images_path)
    labels = read_idx(labels_path)
    if images.ndim != 3 or labels.ndim != 1:
        raise ValueError(
            f"Expected (N, H, W) images and (N,) labels, got {images.shape}"
            f" and {labels.shape}."
        )
    if len(images) != len(labels):
        raise ValueError(
            f"{len(images)} images but {len(labels)} labels in"
            f" {images_path} and {labels_path}."
        )
    return scale_images(images[..., None]), labels.astype(np.int32)


# --------------------------------------------------------------------------
# tensorflow-datasets.


def tfds_split_arrays(name, split, data_dir=None, as_supervised=False):
    """One split of a tensorflow-datasets dataset as NumPy arrays.

    Reads the split in batches and concatenates them (`batch_size=-1` would
    do it in one go, but fails under `tfds.testing.mock_data`).

    Returns:
        A dict feature -> array, or `(x, y)` if `as_supervised`.
    """
    import tensorflow_datasets as tfds  # Heavy import; only when needed.

    with _absl_logs_at_least(logging.ERROR):  # Lookups, no news.
        unreachable = unreachable_hosts(
            tfds.builder(name, data_dir=data_dir).url_infos or {})
    try:
        # Without a network, only prepared data is read (no download), and
        # quietly: on failure the error says it all in one line.
        with _absl_logs_at_least(logging.ERROR if unreachable else None):
            dataset = tfds.load(name, split=split, data_dir=data_dir,
                                as_supervised=as_supervised,
                                download=not unreachable)
    except (AssertionError, OSError) as error:
        # AssertionError: tfds' "could not find data" without download;
        # OSError: requests' errors of a failed download.
        reason = (f"no network ({', '.join(unreachable)} does not resolve)"
                  if unreachable else
                  f"the download failed: {first_line(error)}")
        raise DatasetUnavailableError(
            f"{name} is not prepared in"
            f" {data_dir or 'the tensorflow-datasets folder'} and cannot be"
            f" downloaded: {reason}") from error
    batches = list(tfds.as_numpy(dataset.batch(_TFDS_BATCH)))
    if not batches:
        raise ValueError(f"Split {split!r} of {name!r} is empty.")
    return tf.nest.map_structure(
        lambda *parts: np.concatenate(parts), *batches
    )


@contextlib.contextmanager
def _absl_logs_at_least(level):
    """absl logs (tensorflow-datasets') below `level` off for the block
    (None: unchanged)."""
    verbosity = logging.get_verbosity()  # Larger: more verbose.
    if level is not None:
        logging.set_verbosity(min(verbosity, level))
    try:
        yield
    finally:
        logging.set_verbosity(verbosity)


def unreachable_hosts(urls):
    """The hosts of `urls` that do not resolve (none behind a proxy).

    A name lookup fails at once without a network, where tensorflow-datasets'
    download would retry for minutes.
    """
    if any(os.environ.get(v) for v in _PROXY_VARIABLES):
        return []
    unreachable = []
    for host in sorted({urllib.parse.urlparse(u).hostname for u in urls}):
        if not host:
            continue
        try:
            socket.getaddrinfo(host, 443)
        except OSError:
            unreachable.append(host)
    return unreachable


def first_line(error):
    """The first line of an error's message (or its type's name)."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def scale_images(images):
    """uint8 images as float32 in [0, 1]."""
    return (np.asarray(images, np.float32) / 255.0).astype(np.float32)


def decode_text(strings):
    """An object array of Python str from an array of UTF-8 bytes."""
    return np.array(
        [s.decode("utf-8") if isinstance(s, bytes) else str(s)
         for s in strings],
        dtype=object,
    )


# --------------------------------------------------------------------------
# Images.


def load_image_dataset(name, data_dir=None):
    """Loads an image classification dataset.

    Args:
        name: "fashion_mnist" or "cifar10".
        data_dir: for fashion_mnist, the folder of the IDX files (default
            `DEFAULT_FASHION_MNIST_DIR`; if the files are not there,
            tensorflow-datasets is used, with this `data_dir`); for cifar10,
            tensorflow-datasets' `data_dir`.

    Returns:
        `((x_train, y_train), (x_test, y_test))`: float32 images in [0, 1]
        of shape (N, H, W, C) and int32 labels of shape (N,).
    """
    if name not in IMAGE_DATASETS:
        raise ValueError(
            f"Unknown image dataset {name!r}; expected one of"
            f" {IMAGE_DATASETS}."
        )
    if name == "fashion_mnist":
        files = fashion_mnist_files(data_dir)
        if files is not None:
            return (
                load_idx_images(*files["train"]),
                load_idx_images(*files["test"]),
            )
    result = []
    for split in ("train", "test"):
        x, y = tfds_split_arrays(name, split, data_dir, as_supervised=True)
        result.append((scale_images(x), y.astype(np.int32)))
    return tuple(result)


# --------------------------------------------------------------------------
# Text.


def read_sst2_tsv(path):
    """`(sentences, labels)` of one GLUE SST-2 file (`sentence<TAB>label`).

    The file has a header line and no quoting (a sentence may contain '"').

    Returns:
        An object array of str and an int32 array.
    """
    sentences, labels = [], []
    with open(path, encoding="utf-8", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader, None)
        if header is None or [h.strip() for h in header] != [
            "sentence", "label"
        ]:
            raise ValueError(
                f"{path}: expected the header 'sentence<TAB>label', got"
                f" {header!r}."
            )
        for line, row in enumerate(reader, start=2):
            if not row:
                continue
            if len(row) != 2:
                raise ValueError(
                    f"{path}:{line}: expected 2 tab-separated fields, got"
                    f" {len(row)}."
                )
            sentences.append(row[0])
            labels.append(int(row[1]))
    return np.array(sentences, dtype=object), np.array(labels, np.int32)


def drop_unlabeled_pairs(premises, hypotheses, labels):
    """Drops the SNLI pairs of label -1 (no annotator majority)."""
    keep = np.asarray(labels) >= 0
    return (
        (np.asarray(premises, object)[keep],
         np.asarray(hypotheses, object)[keep]),
        np.asarray(labels)[keep].astype(np.int32),
    )


def _snli_split(split, data_dir):
    features = tfds_split_arrays("snli", split, data_dir)
    return drop_unlabeled_pairs(
        decode_text(features["premise"]),
        decode_text(features["hypothesis"]),
        features["label"],
    )


def _glue_sst2_split(split, data_dir):
    features = tfds_split_arrays("glue/sst2", split, data_dir)
    return (decode_text(features["sentence"]),
            features["label"].astype(np.int32))


def load_text_dataset(name, data_dir=None):
    """Loads a text classification dataset as Python strings.

    Args:
        name: "sst2_tsv" (files `train.tsv` and `dev.tsv` in `data_dir`,
            required), "glue/sst2" (tensorflow-datasets, train / validation)
            or "snli" (tensorflow-datasets, train / test, 3 classes).
        data_dir: the folder of the TSV files for sst2_tsv;
            tensorflow-datasets' `data_dir` for the others.

    Returns:
        `(((x_train, y_train), (x_test, y_test)), num_classes)`. x is an
        object array of str, or for snli a tuple `(premises, hypotheses)` of
        such arrays; y is an int32 array.
    """
    if name == "sst2_tsv":
        if not data_dir:
            raise ValueError(
                "sst2_tsv needs data_dir, the folder of train.tsv and dev.tsv."
            )
        train = read_sst2_tsv(os.path.join(data_dir, "train.tsv"))
        test = read_sst2_tsv(os.path.join(data_dir, "dev.tsv"))
        return (train, test), 2
    if name == "glue/sst2":
        train = _glue_sst2_split("train", data_dir)
        test = _glue_sst2_split("validation", data_dir)
        return (train, test), 2
    if name == "snli":
        train = _snli_split("train", data_dir)
        test = _snli_split("test", data_dir)
        return (train, test), 3
    raise ValueError(
        f"Unknown text dataset {name!r}; expected one of {TEXT_DATASETS}."
    )


# --------------------------------------------------------------------------
# Utilities.


def num_examples(x):
    """The number of examples of x: an array, or a tuple / dict of arrays."""
    return len(tf.nest.flatten(x)[0])


def take(x, indices):
    """`x[indices]` for an array, or for each array of a tuple / dict."""
    return tf.nest.map_structure(lambda a: np.asarray(a)[indices], x)


def subsample(x, y, n, seed=0):
    """n examples of `(x, y)` drawn uniformly without replacement.

    x may be an array or a tuple / dict of arrays (e.g. SNLI pairs, or the
    token ids of a preprocessor). The examples keep their original order.
    If n is None or at least the number of examples, `(x, y)` is returned
    unchanged.
    """
    total = len(y)
    if num_examples(x) != total:
        raise ValueError(
            f"x has {num_examples(x)} examples but y has {total}."
        )
    if n is None or n >= total:
        return x, y
    if n < 0:
        raise ValueError(f"n must be non-negative, got {n}.")
    indices = np.sort(
        np.random.default_rng(seed).choice(total, size=n, replace=False)
    )
    return take(x, indices), np.asarray(y)[indices]


# The seed of the validation split's permutation (`split_validation`): a
# constant, not a run's seed, so that every run of a study (each learning
# rate and seed) holds out the same examples and trains on the same others.
VALIDATION_SPLIT_SEED = 0


def split_validation(x, y, n):
    """`((x_train, y_train), validation)`: n examples of `(x, y)` held out
    as `validation = (x_validation, y_validation)`, the others to train on.

    The held-out examples are the first n of a fixed permutation of the
    examples (`VALIDATION_SPLIT_SEED`, independent of any run's seed and
    of NumPy's global state), so the same `(x, y)` always splits the same
    way. x may be an array or a tuple / dict of arrays (`take`); both parts
    keep the examples' original order. n = 0: `((x, y), None)`, unchanged.

    Raises:
        ValueError: n is not an int >= 0, or leaves no example to train on
            (n >= the number of examples), or x and y differ in length.
    """
    total = len(y)
    if num_examples(x) != total:
        raise ValueError(
            f"x has {num_examples(x)} examples but y has {total}."
        )
    if not (isinstance(n, (int, np.integer)) and not isinstance(n, bool)
            and n >= 0):
        raise ValueError(f"Expected validation_examples={n!r} to be an int"
                         " >= 0.")
    if n == 0:
        return (x, y), None
    if n >= total:
        raise ValueError(
            f"Expected validation_examples={n} < the {total} training"
            " examples (after --max_examples and --imbalance_ratio): at"
            " least one must remain to train on.")
    order = np.random.default_rng(VALIDATION_SPLIT_SEED).permutation(total)
    held_out, kept = np.sort(order[:n]), np.sort(order[n:])
    y = np.asarray(y)
    return (take(x, kept), y[kept]), (take(x, held_out), y[held_out])


def preprocess(preprocessor, x, batch_size=1024):
    """Applies a string preprocessor through tf.data; returns NumPy arrays.

    Args:
        preprocessor: a callable from a batch of strings (or a tuple of
            batches, for sentence pairs) to a dict of tensors, e.g. the
            keras-hub preprocessor of `research.models.make_text_classifier`.
        x: an array of str, or a tuple of them (pairs).
        batch_size: strings per preprocessor call.

    Returns:
        The preprocessor's dict of NumPy arrays, one row per example.
    """
    dataset = text_dataset(preprocessor, x, batch_size=batch_size)
    batches = [
        tf.nest.map_structure(lambda t: t.numpy(), b) for b in dataset
    ]
    if not batches:
        raise ValueError("No examples to preprocess.")
    return tf.nest.map_structure(
        lambda *parts: np.concatenate(parts), *batches
    )


def _as_string_tensors(x):
    if isinstance(x, tuple):
        return tuple(_as_string_tensors(part) for part in x)
    return tf.constant([str(s) for s in x], dtype=tf.string)


def text_dataset(preprocessor, x, y=None, batch_size=32, shuffle_seed=None):
    """A `tf.data.Dataset` of preprocessed batches `x` or `(x, y)`.

    The preprocessor (string ops) runs in the pipeline, so that the model
    itself sees only integer tensors.

    Args:
        preprocessor: as in `preprocess`.
        x: an array of str, or a tuple of them (pairs).
        y: optional labels.
        batch_size: examples per batch (the last batch may be smaller).
        shuffle_seed: if not None, shuffles all examples with this seed
            (once; the order is the same at each iteration).
    """
    features = _as_string_tensors(x)
    elements = features if y is None else (features, np.asarray(y))
    dataset = tf.data.Dataset.from_tensor_slices(elements)
    if shuffle_seed is not None:
        dataset = dataset.shuffle(
            num_examples(x), seed=shuffle_seed,
            reshuffle_each_iteration=False,
        )
    dataset = dataset.batch(batch_size)
    if y is None:
        return dataset.map(
            lambda *features: apply_preprocessor(
                preprocessor, _unsplat(features)
            ),
            num_parallel_calls=tf.data.AUTOTUNE,
        )
    return dataset.map(
        lambda features, labels: (
            apply_preprocessor(preprocessor, features), labels
        ),
        num_parallel_calls=tf.data.AUTOTUNE,
    )


def _unsplat(features):
    # tf.data passes the parts of a tuple element as separate arguments.
    return features[0] if len(features) == 1 else tuple(features)


def apply_preprocessor(preprocessor, x):
    """`preprocessor(x)`, also when x is a `(premises, hypotheses)` pair.

    A keras-hub preprocessor called with one tuple takes it for `(x, y)`;
    with an explicit `y=None` it packs the pair into one sequence
    ([CLS] premise [SEP] hypothesis [SEP], segment ids 0 then 1).
    """
    if isinstance(x, tuple):
        return preprocessor(x, None)
    return preprocessor(x)
