"""Cyclic Poisson batches: `data.poisson_batches(..., groups=b)` and
`data.poisson_batches_from_source(..., groups=b)` (random access).

Example i is in group i mod b; logical step j (counted on across passes)
samples only group (group_offset + j) mod b, at q = min(1, b B / N)
(Choquette-Choo et al. 2023, arXiv 2306.08153).
"""

import math

import numpy as np
from absl.testing import absltest
from absl.testing import parameterized

from tf_dpadam import data as dp_data
from tf_dpadam.data import sampling

import helpers


def _steps(batches, passes=1):
    """The sorted example indices of each logical step, pass after pass
    (each step is `accumulation_steps` physical batches)."""
    k = batches.accumulation_steps
    steps = []
    for _ in range(passes):
        physical = [(by.numpy(), bw.numpy()) for _, by, bw in batches.dataset]
        assert len(physical) == k * batches.steps_per_epoch
        for start in range(0, len(physical), k):
            rows = np.concatenate(
                [by[bw > 0] for by, bw in physical[start:start + k]])
            steps.append(np.sort(rows))
    return steps


def _from_source(test, data, **kwargs):
    """`poisson_batches_from_source` of the records of `data` = (x, y),
    with an explicit seed, which must warn."""
    x, y = data
    with test.assertWarnsRegex(UserWarning, "explicit seed"):
        return dp_data.poisson_batches_from_source(
            [(x[i], y[i]) for i in range(len(y))], **kwargs)


_PIPELINES = {"in_memory": helpers.seeded_poisson_batches,
              "from_source": _from_source}


class CyclicPoissonTest(parameterized.TestCase):

    @parameterized.product(
        (dict(physical_batch_size=None, offset=0),
         dict(physical_batch_size=8, offset=2),
         dict(physical_batch_size=8, offset=7)),
        pipeline=tuple(_PIPELINES))
    def test_each_step_samples_the_next_group_across_passes(
            self, physical_batch_size, offset, pipeline):
        n, batch, groups = 130, 10, 3
        batches = _PIPELINES[pipeline](
            self, helpers.indexed_data(n), expected_batch_size=batch,
            physical_batch_size=physical_batch_size, groups=groups,
            group_offset=offset, seed=11)
        if physical_batch_size is not None:
            self.assertGreater(batches.accumulation_steps, 1)
        # ceil(130 / 10) = 13 steps, rounded up to a multiple of 3.
        self.assertEqual(batches.steps_per_epoch, 15)
        steps = _steps(batches, passes=2)
        self.assertLen(steps, 30)
        seen = np.zeros(n, int)
        for j, rows in enumerate(steps):
            group = (offset + j) % groups
            np.testing.assert_array_equal(rows % groups, group)
            self.assertLen(set(rows.tolist()), len(rows))
            seen[rows] += 1
        # An example joins at most ceil(30 / 3) = 10 steps, and the two
        # passes draw different batches.
        self.assertLessEqual(seen.max(), 10)
        self.assertGreater(seen.sum(), 0)
        self.assertFalse(all(np.array_equal(a, b)
                             for a, b in zip(steps[:15], steps[15:])))

    def test_a_given_steps_per_epoch_is_rounded_up_to_whole_cycles(self):
        batches = helpers.seeded_poisson_batches(
            self, helpers.indexed_data(100), expected_batch_size=5,
            steps_per_epoch=5, groups=4, seed=3)
        self.assertEqual(batches.steps_per_epoch, 8)
        steps = _steps(batches, passes=2)
        for j, rows in enumerate(steps):
            np.testing.assert_array_equal(rows % 4, j % 4)

    @parameterized.parameters(*_PIPELINES)
    def test_inclusion_frequency_is_q_in_the_groups_steps(self, pipeline):
        # 66 = 4 * 16 + 2: groups of 17, 17, 16 and 16 examples (a group
        # whose last example is never read would be far outside the bound).
        n, batch, groups = 66, 4, 4
        q = groups * batch / n  # 0.242
        batches = _PIPELINES[pipeline](
            self, helpers.indexed_data(n), expected_batch_size=batch,
            steps_per_epoch=400, groups=groups, seed=5)
        self.assertEqual(batches.sampling_rate, q)
        counts = np.zeros(n)
        for rows in _steps(batches):
            counts[rows] += 1
        # Each example is drawn in its group's 100 steps: Binomial(100, q)
        # per example, within 5 standard deviations (21.7 draws); the total
        # Binomial(6400, q) within 5 of its (173 draws).
        own_steps = 400 // groups
        sd = math.sqrt(own_steps * q * (1 - q))
        self.assertLess(np.abs(counts - own_steps * q).max(), 5 * sd)
        total_sd = math.sqrt(n * own_steps * q * (1 - q))
        self.assertLess(abs(counts.sum() - n * own_steps * q), 5 * total_sd)

    def test_one_group_gives_the_batches_of_plain_poisson_sampling(self):
        x, y = helpers.indexed_data(200)
        kwargs = dict(expected_batch_size=20, physical_batch_size=8,
                      steps_per_epoch=3, seed=7)
        plain = helpers.seeded_poisson_batches(self, (x, y), **kwargs)
        one = helpers.seeded_poisson_batches(self, (x, y), groups=1, **kwargs)
        shifted = helpers.seeded_poisson_batches(self, (x, y), groups=1, group_offset=5,
                                  **kwargs)
        expected = _steps(plain, passes=2)
        for batches in (one, shifted):
            self.assertEqual(batches._replace(dataset=None),
                             plain._replace(dataset=None))
            got = _steps(batches, passes=2)
            self.assertLen(got, len(expected))
            for a, b in zip(got, expected):
                np.testing.assert_array_equal(a, b)
        self.assertEqual(sampling.poisson_plan_of(one.dataset).groups, 1)

    @parameterized.parameters(*_PIPELINES)
    def test_capacity_rate_and_plan_are_the_groups(self, pipeline):
        n, batch, groups, physical = 400, 20, 5, 8
        batches = _PIPELINES[pipeline](
            self, helpers.indexed_data(n), expected_batch_size=batch,
            physical_batch_size=physical, groups=groups, seed=2)
        q = groups * batch / n
        self.assertEqual(batches.sampling_rate, q)
        self.assertEqual(batches.expected_batch_size, batch)
        population = math.ceil(n / groups)
        capacity = batches.capacity
        self.assertEqual(capacity % physical, 0)
        self.assertEqual(batches.overflow_probability,
                         sampling.binomial_upper_tail(population, q, capacity))
        self.assertLessEqual(batches.overflow_probability, 1e-10)
        # The smallest such multiple of b.
        self.assertGreater(
            sampling.binomial_upper_tail(population, q, capacity - physical),
            1e-10)
        self.assertEqual(
            dp_data.poisson_capacity(n, batch, physical, 1e-10, groups),
            (capacity, batches.overflow_probability))
        plan = sampling.poisson_plan_of(batches.dataset)
        self.assertEqual(plan.groups, groups)
        self.assertEqual(plan.num_examples, n)
        self.assertEqual(plan.expected_batch_size, batch)
        self.assertEqual(plan.accumulation_steps, batches.accumulation_steps)
        self.assertEqual(plan.mechanism(1.0).bands, groups)
        self.assertEqual(plan.mechanism(1.0).sampling_rate, q)
        # Through map_examples too.
        mapped = batches.map_examples(lambda x, y: (x + 1.0, y))
        self.assertEqual(sampling.poisson_plan_of(mapped.dataset), plan)

    @parameterized.named_parameters(
        ("groups_zero", {"groups": 0}, "groups=0"),
        ("groups_too_many", {"groups": 65}, "groups=65"),
        ("groups_float", {"groups": 2.0}, r"groups=2\.0"),
        ("groups_bool", {"groups": True}, "groups=True"),
        ("groups_string", {"groups": "2"}, "groups='2'"),
        ("groups_rate_above_one", {"groups": 11}, "groups=11"),
        ("offset_negative", {"groups": 2, "group_offset": -1},
         "group_offset=-1"),
        ("offset_float", {"groups": 2, "group_offset": 1.0},
         r"group_offset=1\.0"),
    )
    def test_bad_arguments(self, kwargs, name):
        # N = 100, B = 10: at most 10 groups.
        x, y = helpers.indexed_data(100)
        with self.assertRaisesRegex(ValueError, name):
            dp_data.poisson_batches((x, y), expected_batch_size=10, **kwargs)
        with self.assertRaisesRegex(ValueError, name):
            dp_data.poisson_batches_from_source(
                [(x[i], y[i]) for i in range(100)], expected_batch_size=10,
                **kwargs)

    @parameterized.parameters(*_PIPELINES)
    def test_ten_groups_of_ten_sample_every_group_whole(self, pipeline):
        # g B = N: q = 1, each step is its whole group.
        batches = _PIPELINES[pipeline](
            self, helpers.indexed_data(100), expected_batch_size=10, groups=10,
            seed=1)
        self.assertEqual(batches.sampling_rate, 1.0)
        for j, rows in enumerate(_steps(batches)):
            np.testing.assert_array_equal(rows, np.arange(j % 10, 100, 10))


if __name__ == "__main__":
    absltest.main()
