"""tf.distribute replicas: one noise draw in total and the global B.

Also gradient accumulation with replicas: k physical batches on each
replica, one all-reduce and one noise draw per logical step; and correlated
noise (b > 1 bands), whose secret history every replica reads and the first
replica's step writes, once per logical step.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from absl.testing import absltest

from tf_dpadam.privatizer import correlated_noise

import helpers

pytestmark = pytest.mark.slow  # A subprocess with four replicas.

_REPLICAS = 4


class DistributeTest(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        script = os.path.join(os.path.dirname(__file__), "distribute_check.py")
        run = subprocess.run(
            [sys.executable, script, str(_REPLICAS)],
            capture_output=True, text=True, timeout=1200, check=False,
        )
        lines = [l for l in run.stdout.splitlines() if l.startswith("RESULT ")]
        if run.returncode != 0 or not lines:
            raise AssertionError(f"distribute_check.py failed:\n{run.stderr}")
        cls.result = json.loads(lines[-1][len("RESULT "):])

    def test_replicas_give_the_single_device_weights(self):
        self.assertEqual(self.result["replicas"], _REPLICAS)
        for single, replicated in (("single", "replicated"),
                                   ("single_fixed_b", "replicated_fixed_b"),
                                   ("single_sgd", "replicated_sgd")):
            for a, b in zip(self.result[single], self.result[replicated]):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    def test_accumulation_on_replicas_gives_the_single_device_weights(self):
        # k = 2 micro-batches on each of 4 replicas against k = 2 on one
        # device: DPAdamCorrected with the counted B (the count is
        # all-reduced with the sums) and decoupled weight decay, applied
        # once per logical step. A micro-batch counted twice or lost, or one
        # replica's sums missing, moves the weights by far more than 1e-6
        # (distribute_check.py also checks 4 optimizer steps, not 8).
        for a, b in zip(self.result["single_accumulated"],
                        self.result["replicated_accumulated"]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    def test_augmult_on_replicas_gives_the_single_device_weights(self):
        # K = 3 views per example, the views made on each replica: the
        # same weights as on one device (DPAdamCorrected with clipping, so
        # an example's views split across replicas, or counted as 3
        # examples, would move them differently).
        for a, b in zip(self.result["single_augmult"],
                        self.result["replicated_augmult"]):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        # And the views matter: without them the weights differ.
        self.assertFalse(all(
            np.allclose(a, b, rtol=1e-3, atol=1e-4)
            for a, b in zip(self.result["single"],
                            self.result["single_augmult"])))

    def test_adaptive_clipping_on_replicas_gives_the_single_device_run(self):
        # Per-layer adaptive clipping (two counts), with and without
        # accumulation: the weights and the final C of each layer (the last
        # entry) as on one device. A count summed per replica only, or
        # twice, moves C (and so the weights) differently.
        for single, replicated in (
                ("single_adaptive", "replicated_adaptive"),
                ("single_adaptive_accumulated",
                 "replicated_adaptive_accumulated")):
            clips = self.result[single][-1]
            self.assertLen(clips, 2)
            self.assertNotAlmostEqual(clips[0], 0.3 / 2 ** 0.5, places=3)
            for a, b in zip(self.result[single], self.result[replicated]):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)

    def test_noise_is_added_once_over_the_global_batch(self):
        sigma, clip = 1.3, 0.5
        for key, denominator in (("noise_counted_b", 32), ("noise_fixed_b", 40),
                                 ("noise_accumulated", 32)):
            stats = self.result[key]
            expected = sigma * clip / denominator
            # 102,400 coordinates: relative standard error of the sample std
            # is 1/sqrt(2n) = 0.22%; 1.5% is ~7 of them. Noise per replica
            # would give sqrt(R) = 2x, noise scaled by 1/R would give 0.25x;
            # with accumulation (k = 4), noise per micro-batch would give
            # sqrt(k) = 2x, per micro-batch and replica 4x.
            self.assertAlmostEqual(stats["std"] / expected, 1.0, delta=0.015)
            self.assertAlmostEqual(stats["phi"] / expected**2, 1.0, places=5)

    def test_correlated_noise_on_replicas_has_the_strategys_covariance(self):
        # 16 steps of b = 4 bands (the banded inverse square root) on 4
        # replicas, without accumulation (a model that fit builds: its
        # history once failed to be made in a replica's step) and with it
        # (k = 2): the measured
        # T x T covariance of the noise over 102,400 coordinates equals
        # M^-1 M^-T within 6 standard errors of each entry. A history that
        # each replica wrote (plain variables) counted 64 draws and was off
        # by 67 standard errors; independent noise is off too.
        strategy = correlated_noise.BandedToeplitz.bisr(4)
        inverse = np.linalg.inv(strategy.matrix(16))
        independent = np.eye(16)
        for key in ("banded", "banded_accumulated"):
            result = self.result[key]
            self.assertEqual(result["ledger_bands"], [4])
            measured = np.array(result["covariance"])
            self.assertLess(helpers.covariance_standard_errors(
                measured, inverse @ inverse.T, result["size"]), 6.0)
            self.assertGreater(helpers.covariance_standard_errors(
                measured, independent, result["size"]), 6.0)


if __name__ == "__main__":
    absltest.main()
