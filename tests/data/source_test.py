"""src/tf_dpadam/data/__init__.py: Poisson sampling by random access into indexable sources.

`poisson_batches_from_source` draws n ~ Binomial(N, q) and a uniform n-subset
per step, reads those records and shares the padding and splitting of
`poisson_batches`. Tested: the law of the sample (exactly independent
Bernoulli(q) inclusion), that the rows are the records sampled, the seed, the
padding and accumulation, and a 1,000,000-record ArrayRecord file read in
flat memory.
"""

import itertools
import json
import math
import os
import subprocess
import sys
import tempfile
import threading

import keras
import numpy as np
import tensorflow as tf
import tensorflow_datasets as tfds
import pytest
from absl.testing import absltest
from absl.testing import parameterized
from array_record.python import array_record_module
from scipy import stats

import tf_dpadam
from helpers import LOSS
from helpers import classification_data
from helpers import mlp
from helpers import numpy_values
from helpers import seed_everything
from tf_dpadam import data as dp_data
from tf_dpadam.data import source as data_source
from tf_dpadam.data import sampling

import helpers


# Tests that pass by chance fail with probability at most about 1e-6 each.
_P_FAIL = 1e-6


class IndexedSource:
    """N records `(x_i, i)` with x_i = [i + 0.5, -i], read through a log.

    `__getitems__` reads one step's records at once, as ArrayRecord and
    `tfds.data_source` do; `log` keeps the indices of every read.
    """

    def __init__(self, n, batched=True):
        self.n = n
        self.log = []
        self._lock = threading.Lock()
        if batched:
            self.__getitems__ = self._getitems

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if not 0 <= i < self.n:
            raise IndexError(i)
        with self._lock:
            self.log.append((i,))
        return np.array([i + 0.5, -i], "float32"), np.int64(i)

    def _getitems(self, keys):
        with self._lock:
            self.log.append(tuple(keys))
        return [(np.array([i + 0.5, -i], "float32"), np.int64(i))
                for i in keys]


def _x_of(index):
    """The features of `IndexedSource`'s record `index`."""
    index = np.asarray(index)
    return np.stack([index + 0.5, -index], axis=-1).astype("float32")


def _temporary_directory(test):
    """A directory removed after `test` (also under pytest)."""
    directory = tempfile.TemporaryDirectory()
    test.addCleanup(directory.cleanup)
    return directory.name


def _from_source(test, source, **kwargs):
    """`poisson_batches_from_source` with an explicit seed, which must warn."""
    with test.assertWarnsRegex(
            UserWarning, r"poisson_batches_from_source uses the explicit"
            r" seed=\d+: anyone who knows it can regenerate every batch"):
        return dp_data.poisson_batches_from_source(source, **kwargs)


def _steps(batches):
    """Each logical step's (x, y, weight), its k physical batches joined."""
    k = batches.accumulation_steps
    physical = [tuple(t.numpy() for t in s) for s in batches.dataset]
    return [tuple(np.concatenate([p[i] for p in physical[j:j + k]])
                  for i in range(3))
            for j in range(0, len(physical), k)], physical


def _sampled(batches):
    """The indices read at each logical step (the records' own labels)."""
    steps, _ = _steps(batches)
    return [tuple(y[w > 0]) for _, y, w in steps]


def _drawn(seed, batches, num_examples):
    """What the sampler draws for `seed` at each step of the first pass."""
    nonces = sampling.step_nonces().take(batches.steps_per_epoch)
    return [
        tuple(dp_data.poisson_subset(
            num_examples, batches.sampling_rate,
            data_source.step_generator(seed, int(nonce))).tolist())
        for nonce in nonces
    ]


def _two_sided_count_bounds(trials, p, num_variables):
    """[low, high] holding all of `num_variables` Binomial(trials, p) counts
    with probability >= 1 - _P_FAIL (union bound)."""
    tail = _P_FAIL / (2 * num_variables)
    return (int(stats.binom.ppf(tail, trials, p)),
            int(stats.binom.isf(tail, trials, p)) + 1)


def _chi_square_fit(observed, probabilities, min_expected=5.0):
    """The chi-square statistic and degrees of freedom of `observed` against
    `probabilities`, merging adjacent cells until each expects >= 5."""
    total = sum(observed)
    merged, cell_o, cell_p = [], 0, 0.0
    for o, p in zip(observed, probabilities):
        cell_o, cell_p = cell_o + o, cell_p + p
        if cell_p * total >= min_expected:
            merged.append((cell_o, cell_p))
            cell_o, cell_p = 0, 0.0
    if cell_p > 0 or cell_o > 0:
        last_o, last_p = merged.pop()
        merged.append((last_o + cell_o, last_p + cell_p))
    statistic = sum((o - total * p) ** 2 / (total * p) for o, p in merged)
    return statistic, len(merged) - 1


class _IndexedTfds(tfds.core.GeneratorBasedBuilder):
    """300 examples {"x": [i + 0.5, -i], "label": i}, nothing to download."""

    VERSION = tfds.core.Version("1.0.0")

    def _info(self):
        return tfds.core.DatasetInfo(
            builder=self,
            features=tfds.features.FeaturesDict({
                "x": tfds.features.Tensor(shape=(2,), dtype=np.float32),
                "label": tfds.features.Scalar(dtype=np.int64),
            }),
        )

    def _split_generators(self, dl_manager):
        del dl_manager  # nothing to download
        return {"train": self._generate_examples()}

    def _generate_examples(self):
        for i in range(300):
            yield i, {"x": _x_of(i), "label": i}


class SamplerTest(absltest.TestCase):
    """The law of `poisson_subset` and `uniform_subset`."""

    @pytest.mark.slow
    def test_poisson_subset_is_independent_bernoulli_per_example(self):
        # All 2^5 subsets of 5 examples: P(S = s) = q^|s| (1 - q)^(5 - |s|).
        n, q, draws = 5, 0.3, 40_000
        rng = np.random.default_rng(1)
        observed = np.zeros(2**n)
        for _ in range(draws):
            observed[sum(1 << int(i) for i in
                         dp_data.poisson_subset(n, q, rng))] += 1
        sizes = np.array([bin(s).count("1") for s in range(2**n)])
        expected = q**sizes * (1 - q) ** (n - sizes)
        self.assertAlmostEqual(expected.sum(), 1.0)
        statistic, dof = _chi_square_fit(observed, expected)
        self.assertEqual(dof, 31)
        # Chi-square(31) exceeds 77.4 with probability 1e-6.
        self.assertLess(statistic, stats.chi2.isf(_P_FAIL, dof))

    def test_uniform_subset_is_uniform(self):
        # The 20 subsets of size 3 of range(6), each with probability 1/20.
        rng = np.random.default_rng(2)
        subsets = {s: i for i, s in
                   enumerate(itertools.combinations(range(6), 3))}
        observed = np.zeros(len(subsets))
        for _ in range(20_000):
            chosen = dp_data.uniform_subset(6, 3, rng)
            self.assertEqual(chosen.dtype, np.int64)
            observed[subsets[tuple(chosen.tolist())]] += 1  # sorted
        statistic, dof = _chi_square_fit(observed, np.full(20, 1 / 20))
        self.assertLess(statistic, stats.chi2.isf(_P_FAIL, dof))
        # Degenerate sizes.
        self.assertEqual(dp_data.uniform_subset(6, 0, rng).tolist(), [])
        self.assertEqual(dp_data.uniform_subset(6, 6, rng).tolist(),
                         list(range(6)))
        with self.assertRaisesRegex(ValueError, "size=7"):
            dp_data.uniform_subset(6, 7, rng)

    def test_memory_is_o_of_the_sample_not_of_n(self):
        # An N-long mask or permutation of 10^15 examples would not fit.
        rng = np.random.default_rng(3)
        n = 10**15
        chosen = dp_data.poisson_subset(n, 2e-12, rng)
        # Binomial(10^15, 2e-12): mean 2,000, sd 44.7.
        self.assertBetween(len(chosen), 2000 - 6 * 45, 2000 + 6 * 45)
        self.assertTrue(np.all(np.diff(chosen) > 0))  # sorted, distinct
        self.assertBetween(int(chosen.min()), 0, n - 1)
        self.assertBetween(int(chosen.max()), 0, n - 1)
        # Spread over the range: the mean of 2,000 uniform draws on [0, n)
        # is n / 2 with sd n / sqrt(12 * 2000) = 0.0065 n.
        self.assertLess(abs(chosen.mean() / n - 0.5), 6 * 0.0065)


class PoissonBatchesFromSourceTest(parameterized.TestCase):

    def test_inclusion_and_batch_size_statistics(self):
        n, b, steps = 200, 20, 400
        source = IndexedSource(n)
        seed_everything(0)
        batches = dp_data.poisson_batches_from_source(
            source, expected_batch_size=b, steps_per_epoch=steps)
        q = batches.sampling_rate
        self.assertAlmostEqual(q, 0.1)
        counts = np.zeros(n)
        sizes = []
        for step in _sampled(batches):
            self.assertLen(set(step), len(step))  # no example twice
            counts[list(step)] += 1
            sizes.append(len(step))
        # Each example's count is Binomial(400, 0.1) (mean 40, sd 6): all
        # 200 counts lie in [low, high] = [14, 72] with probability
        # 1 - 1e-6, i.e. each example's inclusion frequency is within
        # [0.035, 0.18] of q = 0.1.
        low, high = _two_sided_count_bounds(steps, q, n)
        self.assertBetween(counts.min(), low, high)
        self.assertBetween(counts.max(), low, high)
        # Together: sum((c - 40)^2 / 36) is chi-square(200) for independent
        # examples; a sampler that shuffles passes (under-dispersed) or
        # favours some examples (over-dispersed) falls outside.
        dispersion = np.sum((counts - steps * q) ** 2 / (steps * q * (1 - q)))
        self.assertBetween(dispersion, stats.chi2.ppf(_P_FAIL, n),
                           stats.chi2.isf(_P_FAIL, n))
        # The batch size is Binomial(200, 0.1): chi-square goodness of fit of
        # the 400 sizes (cells merged to expect >= 5 each), and the mean
        # within 5 standard errors (sqrt(18 / 400) = 0.21).
        observed = np.bincount(sizes, minlength=n + 1)
        statistic, dof = _chi_square_fit(
            observed, stats.binom.pmf(np.arange(n + 1), n, q))
        self.assertLess(statistic, stats.chi2.isf(_P_FAIL, dof))
        self.assertLess(abs(np.mean(sizes) - n * q),
                        5 * math.sqrt(n * q * (1 - q) / steps))

    @parameterized.named_parameters(
        ("batched", True, 1), ("one_at_a_time", False, 1),
        ("parallel", True, tf.data.AUTOTUNE),
    )
    def test_reads_exactly_the_sampled_records(self, batched, parallel):
        source = IndexedSource(300, batched=batched)
        batches = _from_source(self, source, expected_batch_size=30,
                               steps_per_epoch=12, seed=4,
                               num_parallel_reads=parallel)
        self.assertEqual(source.log, [(0,)])  # the probe of record 0
        steps, _ = _steps(batches)
        drawn = _drawn(4, batches, 300)
        for (x, y, w), step in zip(steps, drawn):
            real = w > 0
            # The rows are the records drawn, in sorted order, each record
            # with its own features, and nothing else.
            self.assertEqual(tuple(y[real]), step)
            np.testing.assert_array_equal(x[real], _x_of(y[real]))
        # Every record read was drawn and every drawn record read once.
        if batched:  # one read per non-empty step
            self.assertCountEqual(source.log[1:], [d for d in drawn if d])
        else:  # one read per record, step after step
            self.assertEqual([i for (i,) in source.log[1:]],
                             [i for d in drawn for i in d])

    def test_numpy_memmap_source_and_decode(self):
        path = os.path.join(_temporary_directory(self), "records.bin")
        dtype = np.dtype([("x", "<f4", (2,)), ("label", "<i8")])
        records = np.memmap(path, dtype, mode="w+", shape=(300,))
        records["label"] = np.arange(300)
        records["x"] = _x_of(np.arange(300))
        records.flush()
        del records
        source = np.memmap(path, dtype, mode="r")
        from_memmap = _from_source(
            self, source, expected_batch_size=30, steps_per_epoch=6, seed=5,
            decode=lambda rows: (rows["x"], rows["label"]))
        from_list = _from_source(self, IndexedSource(300),
                                 expected_batch_size=30, steps_per_epoch=6,
                                 seed=5)
        self.assertEqual(from_memmap.dataset.element_spec,
                         from_list.dataset.element_spec)
        steps = _steps(from_memmap)[0]  # the first pass of each
        for a, b in zip(steps, _steps(from_list)[0]):
            for u, v in zip(a, b):
                np.testing.assert_array_equal(u, v)
        self.assertEqual([tuple(y[w > 0]) for _, y, w in steps],
                         _drawn(5, from_memmap, 300))

    def test_tfds_array_record_data_source(self):
        # A tfds dataset prepared offline in the ArrayRecord format; its
        # data source returns feature dicts, in tfds' own (shuffled) order.
        builder = _IndexedTfds(data_dir=_temporary_directory(self),
                               file_format="array_record")
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(
                try_download_gcs=False))
        source = builder.as_data_source(split="train")
        self.assertEqual(type(source).__name__, "ArrayRecordDataSource")
        labels = np.array([source[i]["label"] for i in range(len(source))])
        self.assertCountEqual(labels, range(300))
        batches = _from_source(
            self, source, expected_batch_size=30, steps_per_epoch=5,
            seed=10, decode=lambda records: (
                np.stack([r["x"] for r in records]),
                np.array([r["label"] for r in records])))
        steps, _ = _steps(batches)
        self.assertLen(steps, 5)
        for (x, y, w), drawn in zip(steps, _drawn(10, batches, 300)):
            real = w > 0
            np.testing.assert_array_equal(y[real], labels[list(drawn)])
            np.testing.assert_array_equal(x[real], _x_of(y[real]))

    def test_an_explicit_seed_alone_fixes_the_batches(self):
        source = IndexedSource(200)
        runs = []
        for global_seed in (0, 1):
            seed_everything(global_seed)
            batches = _from_source(self, source, expected_batch_size=20,
                                   steps_per_epoch=3, seed=7)
            passes = [_sampled(batches) for _ in range(2)]
            runs.append(passes)
        self.assertEqual(runs[0], runs[1])
        first, second = runs[0]
        self.assertEqual(first, _drawn(7, batches, 200))
        self.assertNotEqual(first, second)  # every pass draws new batches
        other = _from_source(self, source, expected_batch_size=20,
                             steps_per_epoch=3, seed=8)
        self.assertNotEqual(_sampled(other), first)
        # The default seed is secret: two pipelines differ whatever the
        # global seeds. Two independent Bernoulli(0.1) samples of 200
        # coincide with probability (0.1^2 + 0.9^2)^200 = 6e-18.
        default = []
        for _ in range(2):
            seed_everything(0)
            default.append(_sampled(dp_data.poisson_batches_from_source(
                source, expected_batch_size=20, steps_per_epoch=3)))
        for a, b in zip(*default):
            self.assertNotEqual(a, b)

    @parameterized.named_parameters(
        ("padded", None), ("dynamic", 1), ("multiple_of_4", 4)
    )
    def test_padding_and_split_match_the_in_memory_pipeline(self, multiple):
        n, b, physical = 400, 40, 16
        source = IndexedSource(n)
        kwargs = dict(expected_batch_size=b, physical_batch_size=physical,
                      steps_per_epoch=8, pad_to_multiple_of=multiple)
        batches = _from_source(self, source, seed=6, **kwargs)
        x, y = _x_of(np.arange(n)), np.arange(n)
        in_memory = dp_data.poisson_batches((x, y), **kwargs)
        for field in ("sampling_rate", "expected_batch_size", "capacity",
                      "accumulation_steps", "steps_per_epoch",
                      "overflow_probability"):
            self.assertEqual(getattr(batches, field),
                             getattr(in_memory, field), field)
        self.assertEqual(batches.dataset.element_spec,
                         in_memory.dataset.element_spec)
        k = batches.accumulation_steps
        self.assertGreater(k, 1)
        steps, physical_batches = _steps(batches)
        self.assertLen(physical_batches, 8 * k)
        # A NumPy reference of the padding: the m sampled rows first, then
        # zeros of weight 0, to k physical batches of
        # min(b, ceil(max(1, ceil(m / k)) / multiple) * multiple) rows.
        for step, drawn in enumerate(_drawn(6, batches, n)):
            m = len(drawn)
            if multiple is None:
                rows = physical
            else:
                needed = max(1, math.ceil(m / k))
                rows = min(physical, math.ceil(needed / multiple) * multiple)
            want_x = np.zeros((k * rows, 2), "float32")
            want_x[:m] = _x_of(drawn)
            want_y = np.zeros(k * rows, np.int64)
            want_y[:m] = drawn
            want_w = (np.arange(k * rows) < m).astype("float32")
            for j in range(k):
                got = physical_batches[step * k + j]
                part = slice(j * rows, (j + 1) * rows)
                np.testing.assert_array_equal(got[0], want_x[part])
                np.testing.assert_array_equal(got[1], want_y[part])
                np.testing.assert_array_equal(got[2], want_w[part])

    @pytest.mark.slow
    def test_accumulated_padded_steps_train_like_unpadded_ones(self):
        # k physical batches of a logical step, accumulated by the
        # optimizer, equal one unpadded step on the sampled records (no
        # noise; the L2 regularizer shows padding that would count).
        n = 60
        x, y = classification_data(n, d=5, seed=4)
        source = list(zip(x, y))
        batches = _from_source(self, source, expected_batch_size=12,
                               physical_batch_size=8, steps_per_epoch=3,
                               seed=9)
        k = batches.accumulation_steps
        self.assertGreater(k, 1)

        def model(accumulation):
            private = tf_dpadam.make_private(mlp(
                d=5, hidden=7, seed=6,
                kernel_regularizer=keras.regularizers.L2(0.05)))
            private.compile(
                optimizer=tf_dpadam.DPSGD(
                    l2_norm_clip=0.3, noise_multiplier=0.0, batch_size=12,
                    gradient_accumulation_steps=accumulation,
                    learning_rate=0.5),
                loss=LOSS)
            return private

        padded = model(k)
        padded.fit(batches.dataset, verbose=0)
        self.assertEqual(int(padded.optimizer.iterations), 3)
        plain = model(None)
        for drawn in _drawn(9, batches, n):
            plain.train_on_batch(x[list(drawn)], y[list(drawn)])
        for a, b in zip(numpy_values(padded.weights),
                        numpy_values(plain.weights)):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    def test_empty_steps_read_nothing(self):
        # q = 1 / 200: P(empty step) = 0.37; with seed 12, 12 steps include
        # empty ones (checked below), which read no record.
        source = IndexedSource(200)
        batches = _from_source(self, source, expected_batch_size=1,
                               steps_per_epoch=12, seed=12,
                               pad_to_multiple_of=1)
        steps, _ = _steps(batches)
        empty = [s for s in steps if not (s[2] > 0).any()]
        self.assertNotEmpty(empty)
        self.assertEqual(len(empty[0][0]), 1)  # one padding row
        self.assertLen(source.log, 1 + len(steps) - len(empty))

    def test_overflow_raises_instead_of_dropping(self):
        source = IndexedSource(200)
        batches = dp_data.poisson_batches_from_source(
            source, expected_batch_size=100, physical_batch_size=100,
            max_overflow_probability=0.6, steps_per_epoch=50)
        # P(> B) is about 0.47 per step: 50 steps stay within the capacity
        # with probability 0.53^50 = 1.6e-14.
        self.assertEqual(batches.capacity, 100)
        with self.assertRaisesRegex(tf.errors.InvalidArgumentError,
                                    "exceeded the capacity"):
            for _ in batches.dataset:
                pass

    def test_decode_must_keep_one_row_per_record(self):
        source = IndexedSource(50)
        with self.assertRaisesRegex(ValueError, r"\(x, y\) or \(x, y,"
                                    r" sample_weight\), got a ndarray"):
            dp_data.poisson_batches_from_source(
                source, expected_batch_size=5,
                decode=lambda records: np.zeros(len(records)))
        with self.assertRaisesRegex(ValueError, "arrays of 1 rows"):
            dp_data.poisson_batches_from_source(
                source, expected_batch_size=5,
                decode=lambda records: (np.zeros(2), np.zeros(2)))
        # Rows of another shape than record 0's fail the step, loudly.
        batches = dp_data.poisson_batches_from_source(
            source, expected_batch_size=5,
            decode=lambda rs: (np.zeros((len(rs), 1 + (rs[0][1] > 0))),
                               np.stack([r[1] for r in rs])))
        with self.assertRaisesRegex(tf.errors.OpError, "as for record 0"):
            for _ in batches.dataset:
                pass

    @parameterized.named_parameters(
        ("no_len", object(), {"expected_batch_size": 1}, "__len__"),
        ("batch_too_big", IndexedSource(10), {"expected_batch_size": 11},
         "expected_batch_size"),
        ("reads_zero", IndexedSource(10),
         {"expected_batch_size": 2, "num_parallel_reads": 0},
         "num_parallel_reads=0"),
        ("seed_negative", IndexedSource(10),
         {"expected_batch_size": 2, "seed": -1}, "seed=-1"),
    )
    def test_bad_arguments(self, source, kwargs, message):
        with self.assertRaisesRegex(ValueError, message):
            dp_data.poisson_batches_from_source(source, **kwargs)


# The on-disk test: 1,000,000 records of 256 bytes (an int64 index and 62
# float32 features), 311 MB of ArrayRecord, more than the memory bound.
_RECORDS = 1_000_000
_FEATURES = 62
_BATCH = 5_000
_STEPS = 100
_MEMORY_BOUND = 200e6


def _write_array_record(path):
    dtype = np.dtype([("index", "<i8"), ("x", "<f4", (_FEATURES,))])
    writer = array_record_module.ArrayRecordWriter(
        path, "group_size:1,uncompressed")  # group_size 1: random access
    chunk = 100_000
    for start in range(0, _RECORDS, chunk):
        rows = np.zeros(chunk, dtype)
        rows["index"] = np.arange(start, start + chunk)
        rows["x"][:, 0] = rows["index"]
        rows["x"][:, 1:] = np.arange(1, _FEATURES)
        raw, size = rows.tobytes(), dtype.itemsize
        for offset in range(0, len(raw), size):
            writer.write(raw[offset:offset + size])
    writer.close()


class MillionRecordsOnDiskTest(absltest.TestCase):

    @pytest.mark.slow
    def test_flat_memory_and_inclusion_frequencies(self):
        script = os.path.join(helpers.TESTS_DIR,
                              "data_source_memory_check.py")
        # glibc gives each thread that allocates its own arena (up to 8 per
        # core) and keeps what is freed there: with the default, the
        # reads of ArrayRecord's thread pool and tf.data's threads raise the
        # RSS by ~600 MB of freed, cached memory (malloc_stats: ~140 MB in
        # use). Two arenas measure what the pipeline holds.
        env = dict(os.environ, MALLOC_ARENA_MAX="2")
        # The child imports TensorFlow while this process writes the file.
        child = subprocess.Popen(
            [sys.executable, script, str(_FEATURES), str(_BATCH),
             str(_STEPS), "13"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.PIPE, text=True, env=env)
        self.addCleanup(child.kill)
        path = os.path.join(_temporary_directory(self),
                            "records.array_record")
        _write_array_record(path)
        stdout, stderr = child.communicate(path + "\n", timeout=300)
        run = subprocess.CompletedProcess(child.args, child.returncode,
                                          stdout, stderr)
        lines = [l for l in run.stdout.splitlines() if l.startswith("RESULT ")]
        if run.returncode != 0 or not lines:
            raise AssertionError(
                f"data_source_memory_check.py failed:\n{run.stderr}")
        result = json.loads(lines[-1][len("RESULT "):])
        n, q = result["num_examples"], result["sampling_rate"]
        self.assertEqual(n, _RECORDS)
        self.assertEqual(q, _BATCH / _RECORDS)  # global N, expected B
        self.assertLen(result["sizes"], _STEPS)

        # The rows of every step are exactly the records that the sampler
        # drew for it (recomputed from the seed and the step's nonce), and
        # each holds its own index and features.
        self.assertEqual(result["mismatched_steps"], 0)
        self.assertEqual(result["bad_records"], 0)

        # Memory: peak RSS of the pipeline (reading, sampling, decoding,
        # padding, and the child's own bookkeeping: 4 MB of counts) beyond
        # the interpreter with TensorFlow imported, against 311 MB of data.
        growth = result["rss_peak"] - result["rss_before"]
        print(f"RSS: {result['rss_before'] / 1e6:.0f} MB before, peak"
              f" +{growth / 1e6:.0f} MB, after"
              f" +{(result['rss_after'] - result['rss_before']) / 1e6:.0f}"
              f" MB; {result['seconds']:.1f} s", file=sys.stderr)
        self.assertLess(growth, _MEMORY_BOUND)

        # Inclusion frequencies. Each example's count over 100 steps is
        # Binomial(100, 0.005), independently across examples, so the
        # histogram of the 10^6 counts is multinomial with those
        # probabilities: chi-square goodness of fit (cells 0, 1, 2, 3, >= 4
        # after merging), failing with probability 1e-6.
        histogram = result["count_histogram"]
        self.assertEqual(sum(histogram), n)
        statistic, dof = _chi_square_fit(
            histogram + [0], list(stats.binom.pmf(
                np.arange(len(histogram)), _STEPS, q))
            + [stats.binom.sf(len(histogram) - 1, _STEPS, q)])
        self.assertLess(statistic, stats.chi2.isf(_P_FAIL, dof))
        # The overall frequency: 500,000 inclusions expected, sd 705;
        # within 5 sd, i.e. |frequency - q| < 3.5e-5 (0.7% of q).
        inclusions = sum(c * i for i, c in enumerate(histogram))
        sd = math.sqrt(n * _STEPS * q * (1 - q))
        self.assertLess(abs(inclusions - n * _STEPS * q), 5 * sd)
        self.assertEqual(inclusions, sum(result["sizes"]))
        # Per block of 1,000 consecutive examples (no region of the file
        # favoured or missed): Binomial(10^5, 0.005), mean 500, sd 22.3;
        # all 1,000 blocks within 6 sd (each block's frequency within 27%
        # of q) with probability 1 - 2e-6.
        blocks = np.array(result["block_counts"])
        block_sd = math.sqrt(1000 * _STEPS * q * (1 - q))
        self.assertLess(np.max(np.abs(blocks - 1000 * _STEPS * q)),
                        6 * block_sd)
        # The batch sizes: Binomial(10^6, 0.005), mean 5,000 and sd 70.5;
        # their mean over 100 steps within 5 standard errors (35), their
        # variance within the chi-square(99) bounds at 1e-6 each.
        sizes = np.array(result["sizes"])
        self.assertLess(abs(sizes.mean() - _BATCH),
                        5 * math.sqrt(_BATCH * (1 - q) / _STEPS))
        ratio = (_STEPS - 1) * sizes.var(ddof=1) / (_BATCH * (1 - q))
        self.assertBetween(ratio, stats.chi2.ppf(_P_FAIL, _STEPS - 1),
                           stats.chi2.isf(_P_FAIL, _STEPS - 1))


if __name__ == "__main__":
    absltest.main()
