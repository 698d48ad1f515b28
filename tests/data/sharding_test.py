"""Poisson sampling over workers (src/tf_dpadam/data/sharding.py), in one process.

Each worker's pipeline is built from its own `tf.distribute.InputContext`,
as `strategy.distribute_datasets_from_function` would; multi_worker_test.py
trains on them with two real worker processes.
"""

import numpy as np
import pytest
import tensorflow as tf
from absl.testing import absltest
from absl.testing import parameterized

from tf_dpadam.data import sharding


def _indexed_data(num_examples):
    # Row i is (i, 2 i): the rows read can be traced back to their index.
    x = np.stack([np.arange(num_examples), 2 * np.arange(num_examples)],
                 axis=1).astype("float32")
    y = np.arange(num_examples) % 3
    return x, y


def _sampled_steps(batches, steps):
    """Per step and worker, the indices of the rows read (weight 1)."""
    workers = batches.num_workers
    replicas = workers * batches.replicas_per_worker
    per_step = batches.accumulation_steps * batches.replicas_per_worker
    # One element per logical step: the worker's k L physical batches.
    streams = [
        batches.dataset_fn(tf.distribute.InputContext(workers, w, replicas))
        .batch(per_step).take(steps).as_numpy_iterator()
        for w in range(workers)
    ]
    result = []
    for step in zip(*streams):
        rows = []
        for x, y, weight in step:
            assert x.shape[1] == batches.physical_batch_size
            x, y, weight = (a.reshape((-1,) + a.shape[2:])
                            for a in (x, y, weight))
            # Padding rows are zeros of weight 0; the others are the rows
            # of the indices sampled.
            assert not x[weight == 0].any() and not y[weight == 0].any()
            chosen = x[weight > 0]
            np.testing.assert_array_equal(chosen[:, 1], 2 * chosen[:, 0])
            np.testing.assert_array_equal(y[weight > 0], chosen[:, 0] % 3)
            rows.append(chosen[:, 0].astype(int))
        result.append(rows)
    return result


class ShardedPoissonBatchesTest(parameterized.TestCase):

    @parameterized.named_parameters(
        ("two_workers", 2, 1), ("three_workers_of_two_replicas", 3, 2)
    )
    @pytest.mark.slow
    def test_the_union_is_poisson_over_all_examples(self, workers, local):
        num_examples, batch, steps = 1000, 50, 300
        q = batch / num_examples
        batches = sharding.sharded_poisson_batches(
            _indexed_data(num_examples), expected_batch_size=batch,
            physical_batch_size=8, num_workers=workers,
            replicas_per_worker=local,
        )
        self.assertEqual(batches.sampling_rate, q)
        self.assertEqual(batches.expected_batch_size, batch)
        self.assertEqual(batches.num_examples, num_examples)
        counts = np.zeros(num_examples)
        sizes = []
        for step in _sampled_steps(batches, steps):
            for worker, rows in enumerate(step):
                # Each worker reads only its own shard.
                np.testing.assert_array_equal(rows % workers, worker)
            union = np.concatenate(step)
            self.assertLen(np.unique(union), len(union))
            counts[union] += 1
            sizes.append(len(union))
        # Inclusion frequency of each shard: 300 steps of ~333-500 examples
        # Bernoulli(0.05): standard error <= sqrt(q (1 - q) / 99,900) =
        # 6.9e-4, 5 of them are 3.4e-3 (7% of q). Sampling each shard at
        # q / W or q W is off by 50% or more.
        for worker in range(workers):
            rate = counts[worker::workers].mean() / steps
            self.assertAlmostEqual(rate, q, delta=3.4e-3)
        # The union's size is Binomial(N, q): mean B = 50 (standard error of
        # the mean over 300 steps sqrt(47.5 / 300) = 0.4, 5 of them 2.0) and
        # variance N q (1 - q) = 47.5 (relative standard error of the sample
        # variance sqrt(2 / 299) = 8%; 30% is ~4 of them). Workers drawing
        # the same mask over their shards would double the variance.
        self.assertAlmostEqual(np.mean(sizes), batch, delta=2.0)
        self.assertAlmostEqual(np.var(sizes, ddof=1) / (num_examples * q * (1 - q)),
                               1.0, delta=0.3)

    def test_every_worker_takes_the_same_k_micro_batches(self):
        # 1001 examples over 2 workers: shards of 501 and 500, one capacity.
        batches = sharding.sharded_poisson_batches(
            _indexed_data(1001), expected_batch_size=100,
            physical_batch_size=16, num_workers=2, replicas_per_worker=2,
        )
        self.assertEqual(batches.capacity,
                         batches.accumulation_steps * 2 * 16)
        self.assertEqual(batches.steps_per_epoch, 11)  # ceil(1001 / 100)
        self.assertEqual(batches.micro_steps_per_epoch,
                         11 * batches.accumulation_steps)
        self.assertLess(batches.overflow_probability, 2e-10)

    def test_an_explicit_seed_repeats_and_workers_are_independent(self):
        data = _indexed_data(400)

        def steps(seed):
            with self.assertWarnsRegex(UserWarning, "explicit seed"):
                batches = sharding.sharded_poisson_batches(
                    data, expected_batch_size=40, physical_batch_size=8,
                    num_workers=2, seed=seed,
                )
            return _sampled_steps(batches, 3)

        first, again, other = steps(7), steps(7), steps(8)
        for a, b in zip(first, again):
            for rows_a, rows_b in zip(a, b):
                np.testing.assert_array_equal(rows_a, rows_b)
        self.assertNotEqual(
            [list(r) for s in first for r in s],
            [list(r) for s in other for r in s],
        )
        # Worker 1's shard is not worker 0's mask shifted by one index.
        self.assertNotEqual([list(s[0] + 1) for s in first],
                            [list(s[1]) for s in first])

    def test_a_pipeline_refuses_another_strategy(self):
        batches = sharding.sharded_poisson_batches(
            _indexed_data(100), expected_batch_size=10,
            physical_batch_size=8, num_workers=2,
        )
        with self.assertRaisesRegex(ValueError, "2 workers of 1 replicas"):
            batches.dataset_fn(tf.distribute.InputContext(1, 0, 1))

    def test_arguments_are_checked(self):
        data = _indexed_data(10)
        with self.assertRaisesRegex(ValueError, "num_workers=11"):
            sharding.sharded_poisson_batches(
                data, expected_batch_size=2, physical_batch_size=2,
                num_workers=11,
            )
        with self.assertRaisesRegex(ValueError, "same first dimension"):
            sharding.sharded_poisson_batches(
                (data[0], data[1][:9]), expected_batch_size=2,
                physical_batch_size=2,
            )
        with self.assertRaisesRegex(ValueError, "expected_batch_size=20"):
            sharding.sharded_poisson_batches(
                data, expected_batch_size=20, physical_batch_size=2,
            )

    def test_workers_and_local_replicas_of_the_default_strategy(self):
        self.assertEqual(
            sharding.workers_and_local_replicas(tf.distribute.get_strategy()),
            (1, 1),
        )


if __name__ == "__main__":
    absltest.main()
