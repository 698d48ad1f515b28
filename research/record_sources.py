"""Training sets read by random access (`--data_source`), not into memory.

A tensorflow-datasets dataset prepared in the ArrayRecord format
(`download_and_prepare(file_format="array_record")`) is read record by
record: Poisson sampling (`tf_dpadam.data.poisson_batches_from_source`)
reads only each step's sampled records, so memory stays flat in N. Images
(`image_data_source`) and sentences or sentence pairs (`text_data_source`,
tokenized in the pipeline); the evaluation split is read into memory.
"""

import dataclasses
import os

import numpy as np

from research import datasets


@dataclasses.dataclass(frozen=True)
class RecordSource:
    """Training data read by random access (`--data_source`), not in memory.

    Attributes:
        source: an indexable source of records (`len`, `[i]`), e.g. the
            ArrayRecord data source of a prepared tensorflow-datasets split.
        decode: maps a list of records to `(x, y)` arrays.
    """

    source: object
    decode: object
    # Optional: a tf.data map applied to every (x, y, sample_weight) batch
    # after sampling and padding (e.g. a keras-hub preprocessor on strings).
    transform: object = None

    def __len__(self):
        return len(self.source)


def _decode_image_records(records):
    return (datasets.scale_images(np.stack([r["image"] for r in records])),
            np.asarray([r["label"] for r in records], np.int32))


def image_data_source(name_or_path, data_dir=None):
    """An image dataset prepared by tensorflow-datasets, by random access.

    The train split is a `RecordSource` over tfds' ArrayRecord data source
    (`builder.as_data_source`), so that Poisson sampling reads only the
    sampled records and memory stays flat in N
    (`tf_dpadam.data.poisson_batches_from_source`); the test split is read
    into memory.

    Args:
        name_or_path: a tfds dataset name prepared in `data_dir` (in the
            ArrayRecord format: `download_and_prepare(file_format=
            "array_record")`), or the folder of one (`.../name/version`).
        data_dir: tfds' data folder for a name.

    Returns:
        `(train, (x_test, y_test), num_classes)`: a `RecordSource` of
        float32 images in [0, 1] with int32 labels, the test arrays, and
        the number of classes.

    Raises:
        DatasetUnavailableError: if the dataset is not prepared there (no
            download is attempted) or not in a random-access format.
    """
    builder, (train, test) = _tfds_data_sources(
        name_or_path, data_dir, (("train",), ("test",)))
    x_test, y_test = _decode_image_records(
        [test[i] for i in range(len(test))])
    num_classes = builder.info.features["label"].num_classes
    return RecordSource(train, _decode_image_records), (x_test, y_test), \
        num_classes


def _text_records(records):
    """`(x, y, sample_weight)` of text records: sentences (SST-2's
    "sentence") or pairs (SNLI's "premise" and "hypothesis"); the examples
    without a gold label (-1) get weight 0, i.e. they are absent (a record
    is sampled at the same rate q either way, so the accounting holds)."""
    labels = np.asarray([r["label"] for r in records], np.int64)
    if "premise" in records[0]:
        x = (datasets.decode_text([r["premise"] for r in records]),
             datasets.decode_text([r["hypothesis"] for r in records]))
    else:
        x = datasets.decode_text([r["sentence"] for r in records])
    weight = (labels >= 0).astype(np.float32)
    return x, np.maximum(labels, 0).astype(np.int32), weight


def _tfds_data_sources(name_or_path, data_dir, splits):
    """tfds' random-access sources of the first existing of each split
    tuple, and the builder."""
    import tensorflow_datasets as tfds  # Heavy import; only when needed.

    try:
        if os.path.isdir(name_or_path):
            builder = tfds.builder_from_directory(name_or_path)
        else:
            builder = tfds.builder(name_or_path, data_dir=data_dir)
        available = set(builder.info.splits)
        chosen = []
        for names in splits:
            found = [n for n in names if n in available]
            if not found:
                raise ValueError(f"no split among {names}")
            chosen.append(builder.as_data_source(split=found[0]))
    except Exception as error:  # tfds raises many kinds here.
        raise datasets.DatasetUnavailableError(
            f"--data_source={name_or_path}: not a tensorflow-datasets dataset"
            " prepared in the ArrayRecord format"
            f" ({datasets.first_line(error)}); prepare it with"
            " download_and_prepare(file_format='array_record')") from error
    return builder, chosen


def data_source_num_classes(name_or_path, data_dir=None):
    """The classes of a tfds dataset prepared for random access (its
    "label" feature), without reading any record."""
    builder, _ = _tfds_data_sources(name_or_path, data_dir, (("train",),))
    return builder.info.features["label"].num_classes


def text_data_source(name_or_path, preprocessor, data_dir=None):
    """A text dataset prepared by tensorflow-datasets, by random access.

    Like `image_data_source`, for sentence ("sentence", e.g. glue/sst2) or
    pair ("premise", "hypothesis", e.g. snli) classification: each step's
    records are decoded to strings, and `preprocessor` tokenizes the padded
    batches in the tf.data pipeline (`RecordSource.transform`).

    Returns:
        `(train, (x_test, y_test), num_classes)`: a `RecordSource` of
        `(strings, labels, sample weights)`, the preprocessed evaluation
        split ("validation", else "test") without its unlabeled examples,
        and the number of classes.
    """
    builder, (train, test) = _tfds_data_sources(
        name_or_path, data_dir, (("train",), ("validation", "test")))

    def transform(x, y, weight):
        return datasets.apply_preprocessor(preprocessor, x), y, weight

    x_test, y_test, weight = _text_records([test[i] for i in range(len(test))])
    keep = weight > 0
    x_test = (tuple(part[keep] for part in x_test)
              if isinstance(x_test, tuple) else x_test[keep])
    num_classes = builder.info.features["label"].num_classes
    return (RecordSource(train, _text_records, transform),
            (datasets.preprocess(preprocessor, x_test), y_test[keep]),
            num_classes)
