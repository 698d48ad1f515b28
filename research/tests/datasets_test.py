"""Tests of research.datasets.

tensorflow-datasets cannot download here: its loaders are tested under
`tfds.testing.mock_data`. The real Fashion-MNIST (Debian's
dataset-fashion-mnist) and SST-2 TSV files are tested when present (SST-2:
$SST2_DATA_DIR, else ../shared/data/sst2 beside the repository).
"""

import gzip
import os
import socket
import struct
import tempfile
from unittest import mock

from absl.testing import absltest
from absl.testing import parameterized
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds

from research import datasets

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
SST2_DIR = os.environ.get(
    "SST2_DATA_DIR",
    os.path.join(REPO_ROOT, os.pardir, "shared", "data", "sst2"),
)


def idx_bytes(array, type_code=0x08):
    """An IDX file of `array` (big-endian values)."""
    dtype = {0x08: ">u1", 0x0C: ">i4", 0x0D: ">f4"}[type_code]
    header = bytes([0, 0, type_code, array.ndim])
    header += struct.pack(">" + "I" * array.ndim, *array.shape)
    return header + np.asarray(array, dtype).tobytes()


def write_fashion_mnist(folder, num_train, num_test, gzipped=True, seed=0):
    """Fake Fashion-MNIST IDX files; returns the arrays written."""
    rng = np.random.default_rng(seed)
    arrays = {}
    for split, n in (("train", num_train), ("test", num_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=(n,), dtype=np.uint8)
        arrays[split] = (images, labels)
        for stem, array in zip(datasets.FASHION_MNIST_FILES[split],
                               (images, labels)):
            data = idx_bytes(array)
            if gzipped:
                with gzip.open(os.path.join(folder, stem + ".gz"), "wb") as f:
                    f.write(data)
            else:
                with open(os.path.join(folder, stem), "wb") as f:
                    f.write(data)
    return arrays


def write_tsv(path, lines):
    with open(path, "w", encoding="utf-8", newline="") as f:
        f.write("".join(line + "\n" for line in lines))


class IdxTest(parameterized.TestCase):

    @parameterized.parameters(
        (np.arange(24, dtype=np.uint8).reshape(2, 3, 4), 0x08),
        (np.array([-5, 0, 70000], np.int32), 0x0C),
        (np.array([[1.5, -2.25]], np.float32), 0x0D),
    )
    def test_parse_round_trip(self, array, type_code):
        parsed = datasets.parse_idx(idx_bytes(array, type_code))
        np.testing.assert_array_equal(parsed, array)
        self.assertIn(parsed.dtype.byteorder, ("=", "|"))

    def test_rejects_bad_magic_and_truncation(self):
        data = idx_bytes(np.zeros((2, 2), np.uint8))
        with self.assertRaisesRegex(ValueError, "magic"):
            datasets.parse_idx(b"\x01" + data[1:])
        with self.assertRaisesRegex(ValueError, "type byte"):
            datasets.parse_idx(data[:2] + b"\x07" + data[3:])
        with self.assertRaisesRegex(ValueError, "bytes"):
            datasets.parse_idx(data[:-1])

    @parameterized.parameters(True, False)
    def test_load_fashion_mnist_from_idx_files(self, gzipped):
        with tempfile.TemporaryDirectory() as folder:
            arrays = write_fashion_mnist(folder, 7, 3, gzipped=gzipped)
            (x_train, y_train), (x_test, y_test) = (
                datasets.load_image_dataset("fashion_mnist", folder)
            )
        self.assertEqual(x_train.shape, (7, 28, 28, 1))
        self.assertEqual(x_test.shape, (3, 28, 28, 1))
        self.assertEqual(x_train.dtype, np.float32)
        self.assertEqual(y_train.dtype, np.int32)
        np.testing.assert_allclose(
            x_train[..., 0], arrays["train"][0] / 255.0, rtol=1e-6
        )
        np.testing.assert_array_equal(y_train, arrays["train"][1])
        np.testing.assert_array_equal(y_test, arrays["test"][1])

    def test_files_missing_means_none(self):
        with tempfile.TemporaryDirectory() as folder:
            write_fashion_mnist(folder, 2, 2)
            os.remove(os.path.join(folder, "t10k-labels-idx1-ubyte.gz"))
            self.assertIsNone(datasets.fashion_mnist_files(folder))

    def test_mismatched_counts_raise(self):
        with tempfile.TemporaryDirectory() as folder:
            images = os.path.join(folder, "images")
            labels = os.path.join(folder, "labels")
            with open(images, "wb") as f:
                f.write(idx_bytes(np.zeros((3, 2, 2), np.uint8)))
            with open(labels, "wb") as f:
                f.write(idx_bytes(np.zeros((2,), np.uint8)))
            with self.assertRaisesRegex(ValueError, "3 images but 2 labels"):
                datasets.load_idx_images(images, labels)


class RealFashionMnistTest(absltest.TestCase):

    def test_debian_files(self):
        if datasets.fashion_mnist_files() is None:
            self.skipTest(
                f"No Fashion-MNIST in {datasets.DEFAULT_FASHION_MNIST_DIR}"
                " (apt-get install dataset-fashion-mnist)."
            )
        (x_train, y_train), (x_test, y_test) = datasets.load_image_dataset(
            "fashion_mnist"
        )
        self.assertEqual(x_train.shape, (60000, 28, 28, 1))
        self.assertEqual(x_test.shape, (10000, 28, 28, 1))
        self.assertEqual(x_train.dtype, np.float32)
        self.assertEqual(float(x_train.min()), 0.0)
        self.assertEqual(float(x_train.max()), 1.0)
        # Fashion-MNIST is balanced: 6000 / 1000 examples of each class.
        np.testing.assert_array_equal(np.bincount(y_train), [6000] * 10)
        np.testing.assert_array_equal(np.bincount(y_test), [1000] * 10)


class TfdsImageTest(parameterized.TestCase):

    @parameterized.parameters(
        ("cifar10", (32, 32, 3)),
        ("fashion_mnist", (28, 28, 1)),
    )
    def test_mock_tfds(self, name, shape):
        # An empty data_dir: fashion_mnist falls back to tfds.
        with tempfile.TemporaryDirectory() as folder, \
                tfds.testing.mock_data(num_examples=5):
            (x_train, y_train), (x_test, y_test) = (
                datasets.load_image_dataset(name, folder)
            )
        self.assertEqual(x_train.shape, (5,) + shape)
        self.assertEqual(x_test.shape, (5,) + shape)
        self.assertEqual(x_train.dtype, np.float32)
        self.assertEqual(y_train.dtype, np.int32)
        self.assertBetween(float(x_train.min()), 0.0, 1.0)
        self.assertBetween(float(x_train.max()), 0.0, 1.0)
        self.assertTrue(np.all((y_test >= 0) & (y_test < 10)))

    def test_unknown_name(self):
        with self.assertRaisesRegex(ValueError, "Unknown image dataset"):
            datasets.load_image_dataset("mnist")

    def test_tfds_builder_works_offline_up_to_the_download(self):
        # The `examples` extra installs what tfds imports: without
        # importlib_resources, reading the builder's checksums (code_path)
        # fails with ModuleNotFoundError before any download.
        with tempfile.TemporaryDirectory() as folder:
            builder = tfds.builder("cifar10", data_dir=folder)
            self.assertFalse(builder.is_prepared())
            self.assertEqual(builder.info.features["label"].num_classes, 10)
            self.assertEqual(
                [u.rsplit("/", 1)[-1] for u in builder.url_infos],
                ["cifar-10-binary.tar.gz"])

    @parameterized.parameters("cifar10", "fashion_mnist")
    def test_no_network_is_one_error_at_once(self, name):
        # Every host lookup fails, as without a network: no download is
        # tried (tfds would retry for minutes), the error says why.
        with tempfile.TemporaryDirectory() as folder, \
                mock.patch.object(socket, "getaddrinfo",
                                  side_effect=socket.gaierror("no network")):
            with self.assertRaisesRegex(
                    datasets.DatasetUnavailableError,
                    rf"^{name} is not prepared in {folder} and cannot be"
                    r" downloaded: no network \(\S+ does not resolve\)$"):
                datasets.load_image_dataset(name, folder)

    def test_hosts_behind_a_proxy_count_as_reachable(self):
        urls = ["https://nowhere.invalid/data.tar.gz"]
        with mock.patch.dict(os.environ):
            for variable in datasets._PROXY_VARIABLES:
                os.environ.pop(variable, None)
            self.assertEqual(datasets.unreachable_hosts(urls),
                             ["nowhere.invalid"])
        with mock.patch.dict(os.environ,
                             {"HTTPS_PROXY": "http://proxy:3128"}):
            self.assertEqual(datasets.unreachable_hosts(urls), [])


class Sst2TsvTest(absltest.TestCase):

    def test_reads_unquoted_tsv(self):
        with tempfile.TemporaryDirectory() as folder:
            write_tsv(os.path.join(folder, "train.tsv"), [
                "sentence\tlabel",
                'a "quoted" word \t1',
                "it 's bad , really\t0",
            ])
            write_tsv(os.path.join(folder, "dev.tsv"), [
                "sentence\tlabel",
                '" lonely quote\t1',
            ])
            ((x_train, y_train), (x_test, y_test)), num_classes = (
                datasets.load_text_dataset("sst2_tsv", folder)
            )
        self.assertEqual(num_classes, 2)
        self.assertEqual(
            list(x_train), ['a "quoted" word ', "it 's bad , really"]
        )
        np.testing.assert_array_equal(y_train, [1, 0])
        self.assertEqual(y_train.dtype, np.int32)
        self.assertEqual(list(x_test), ['" lonely quote'])
        self.assertIsInstance(x_test[0], str)

    def test_bad_header_and_rows(self):
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "bad.tsv")
            write_tsv(path, ["text\tlabel", "x\t1"])
            with self.assertRaisesRegex(ValueError, "header"):
                datasets.read_sst2_tsv(path)
            write_tsv(path, ["sentence\tlabel", "x\t1\textra"])
            with self.assertRaisesRegex(ValueError, ":2: expected 2"):
                datasets.read_sst2_tsv(path)

    def test_needs_data_dir(self):
        with self.assertRaisesRegex(ValueError, "data_dir"):
            datasets.load_text_dataset("sst2_tsv")

    def test_real_files(self):
        if not os.path.isfile(os.path.join(SST2_DIR, "train.tsv")):
            self.skipTest(f"No SST-2 TSV files in {SST2_DIR}.")
        ((x_train, y_train), (x_test, y_test)), num_classes = (
            datasets.load_text_dataset("sst2_tsv", SST2_DIR)
        )
        self.assertEqual(num_classes, 2)
        self.assertLen(x_train, 67349)
        self.assertLen(y_train, 67349)
        self.assertLen(x_test, 872)
        self.assertEqual(int(y_train.sum()), 37569)
        self.assertEqual(int(y_test.sum()), 444)
        self.assertTrue(all(isinstance(s, str) and s for s in x_train))


class TfdsTextTest(absltest.TestCase):

    def test_glue_sst2(self):
        with tfds.testing.mock_data(num_examples=6):
            ((x_train, y_train), (x_test, y_test)), num_classes = (
                datasets.load_text_dataset("glue/sst2")
            )
        self.assertEqual(num_classes, 2)
        self.assertLen(x_train, 6)
        self.assertLen(x_test, 6)
        self.assertIsInstance(x_train[0], str)
        self.assertEqual(y_train.dtype, np.int32)
        self.assertTrue(np.all((y_train >= 0) & (y_train < 2)))

    def test_snli(self):
        with tfds.testing.mock_data(num_examples=6):
            ((x_train, y_train), (x_test, y_test)), num_classes = (
                datasets.load_text_dataset("snli")
            )
        self.assertEqual(num_classes, 3)
        premises, hypotheses = x_train
        self.assertLen(premises, len(y_train))
        self.assertLen(hypotheses, len(y_train))
        self.assertIsInstance(premises[0], str)
        self.assertIsInstance(x_test, tuple)
        self.assertTrue(np.all((y_test >= 0) & (y_test < 3)))

    def test_drop_unlabeled_pairs(self):
        (premises, hypotheses), labels = datasets.drop_unlabeled_pairs(
            ["p0", "p1", "p2"], ["h0", "h1", "h2"], np.array([2, -1, 0])
        )
        self.assertEqual(list(premises), ["p0", "p2"])
        self.assertEqual(list(hypotheses), ["h0", "h2"])
        np.testing.assert_array_equal(labels, [2, 0])

    def test_unknown_name(self):
        with self.assertRaisesRegex(ValueError, "Unknown text dataset"):
            datasets.load_text_dataset("imdb")


class UtilitiesTest(parameterized.TestCase):

    def test_subsample_arrays(self):
        x = np.arange(100) * 10
        y = np.arange(100)
        xs, ys = datasets.subsample(x, y, 10, seed=3)
        self.assertLen(ys, 10)
        self.assertLen(set(ys.tolist()), 10)
        np.testing.assert_array_equal(xs, ys * 10)
        self.assertTrue(np.all(np.diff(ys) > 0))
        again = datasets.subsample(x, y, 10, seed=3)[1]
        np.testing.assert_array_equal(ys, again)
        other = datasets.subsample(x, y, 10, seed=4)[1]
        self.assertFalse(np.array_equal(ys, other))

    def test_subsample_structures(self):
        y = np.arange(6)
        pairs = (
            np.array(list("abcdef"), object),
            np.array(list("ABCDEF"), object),
        )
        (p, h), ys = datasets.subsample(pairs, y, 3, seed=0)
        self.assertEqual([s.upper() for s in p], list(h))
        self.assertEqual(list(p), [pairs[0][i] for i in ys])
        tokens = {"token_ids": np.arange(12).reshape(6, 2)}
        xs, ys = datasets.subsample(tokens, y, 2, seed=0)
        np.testing.assert_array_equal(xs["token_ids"][:, 0], ys * 2)

    @parameterized.parameters(None, 6, 100)
    def test_subsample_all(self, n):
        x, y = np.arange(6), np.arange(6)
        xs, ys = datasets.subsample(x, y, n)
        self.assertIs(xs, x)
        self.assertIs(ys, y)

    def test_subsample_length_mismatch(self):
        with self.assertRaisesRegex(ValueError, "5 examples but y has 6"):
            datasets.subsample(np.arange(5), np.arange(6), 2)

    def test_text_dataset_and_preprocess(self):
        def preprocessor(x, y=None):
            if isinstance(x, tuple):
                x = tf.strings.join(list(x), separator="|")
            return {"length": tf.strings.length(x)}

        sentences = np.array(["a", "bcd", "ef"], object)
        dataset = datasets.text_dataset(
            preprocessor, sentences, np.array([0, 1, 0]), batch_size=2
        )
        batches = [(x["length"].numpy().tolist(), y.numpy().tolist())
                   for x, y in dataset]
        self.assertEqual(batches, [([1, 3], [0, 1]), ([2], [0])])
        pairs = (sentences, np.array(["x", "y", "zz"], object))
        arrays = datasets.preprocess(preprocessor, pairs, batch_size=2)
        np.testing.assert_array_equal(arrays["length"], [3, 5, 5])
        shuffled = datasets.text_dataset(
            preprocessor, sentences, np.arange(3), batch_size=3,
            shuffle_seed=0,
        )
        labels = [y.numpy().tolist() for _, y in shuffled][0]
        self.assertCountEqual(labels, [0, 1, 2])


if __name__ == "__main__":
    absltest.main()
