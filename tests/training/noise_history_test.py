"""`noise_history.NoiseHistory`: the secret state of correlated noise.

The end-to-end properties (covariance across a resume, refusals, never in a
`.keras` file) are in `correlated_noise_fit_test.py`; here the holder's own
contract: it continues `correlate`'s recursion exactly, its NumPy values
restore the same stream, a restore with another strategy is refused, and
one that does not fit the weights starts again at zero.
"""

import numpy as np
import tensorflow as tf
from absl.testing import absltest

from tf_dpadam.privatizer import correlated_noise
from tf_dpadam.training import noise_history

SHAPES = ((3, 2), (5,))


def _draws(steps, seed=0):
    rng = np.random.default_rng(seed)
    return [[rng.normal(size=s).astype("float32") for s in SHAPES]
            for _ in range(steps)]


def _run(history, strategy, draws):
    """Each step's correlated noise through `history` (eager)."""
    out = []
    for z in draws:
        state = history.state(strategy, SHAPES)
        noise, _, state = correlated_noise.correlate(
            strategy, [tf.constant(v) for v in z], state)
        history.assign(state)
        out.append([n.numpy() for n in noise])
    return out


def _reference(strategy, draws):
    """w = M^-1 z per coordinate (NumPy, float64)."""
    inverse = np.linalg.inv(strategy.matrix(len(draws)))
    return [[sum(inverse[t, s] * draws[s][i] for s in range(t + 1))
             for i in range(len(SHAPES))] for t in range(len(draws))]


class NoiseHistoryTest(absltest.TestCase):

    def test_continues_the_recursion_and_counts_draws(self):
        strategy = correlated_noise.BandedToeplitz.bisr(3)
        draws = _draws(7)
        history = noise_history.NoiseHistory()
        self.assertEqual(history.draws, 0)
        self.assertIsNone(history.to_numpy())
        noise = _run(history, strategy, draws)
        self.assertEqual(history.draws, 7)
        for mine, theirs in zip(noise, _reference(strategy, draws)):
            for a, b in zip(mine, theirs):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    def test_restored_values_continue_the_same_stream(self):
        strategy = correlated_noise.BandedToeplitz.optimized(4, 16)
        draws = _draws(9, seed=1)
        whole = _run(noise_history.NoiseHistory(), strategy, draws)
        first = noise_history.NoiseHistory()
        _run(first, strategy, draws[:5])
        second = noise_history.NoiseHistory()
        second.restore(first.to_numpy())
        rest = _run(second, strategy, draws[5:])
        self.assertEqual(second.draws, 9)
        for mine, theirs in zip(rest, whole[5:]):
            for a, b in zip(mine, theirs):
                np.testing.assert_array_equal(a, b)
        # Without the restore the stream would differ (the test can fail).
        fresh = _run(noise_history.NoiseHistory(), strategy, draws[5:])
        self.assertFalse(np.allclose(fresh[0][0], whole[5][0]))

    def test_restore_with_another_strategy_refused(self):
        history = noise_history.NoiseHistory()
        _run(history, correlated_noise.BandedToeplitz.bisr(4), _draws(2))
        resumed = noise_history.NoiseHistory()
        resumed.restore(history.to_numpy())
        with self.assertRaisesRegex(ValueError, "noise_strategy"):
            resumed.state(correlated_noise.BandedToeplitz.bisr(2), SHAPES)

    def test_values_of_other_weights_start_at_zero(self):
        strategy = correlated_noise.BandedToeplitz.bisr(2)
        history = noise_history.NoiseHistory()
        _run(history, strategy, _draws(3))
        values = history.to_numpy()
        values["history_0"] = np.zeros((1, 4, 4), "float32")
        resumed = noise_history.NoiseHistory()
        resumed.restore(values)
        with self.assertLogs(level="WARNING"):
            state = resumed.state(strategy, SHAPES)
        self.assertEqual(int(state.draws), 0)
        self.assertEqual(resumed.draws, 0)

    def test_another_strategy_in_process_starts_a_new_history(self):
        history = noise_history.NoiseHistory()
        _run(history, correlated_noise.BandedToeplitz.bisr(2), _draws(3))
        state = history.state(correlated_noise.BandedToeplitz.bisr(4), SHAPES)
        self.assertEqual(int(state.draws), 0)
        self.assertEqual(state.history[0].shape, (3, 3, 2))


if __name__ == "__main__":
    absltest.main()
