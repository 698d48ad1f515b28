"""research/study_moments.py: the statistics of Adam's second moment on
hand-made moments (hand-computed values in the comments)."""

import numpy as np
from absl.testing import absltest

from research import study_moments


class MomentsTest(absltest.TestCase):

    def test_statistics_of_hand_made_moments(self):
        phi, beta_2, steps = 1e-4, 0.9, 2
        correction = 1 - beta_2 ** steps  # 0.19
        # v_hat - Phi = (0, 1, 2, 3, 4, 5) x 1e-5 -> ratio / Phi 0 ... 0.5.
        v_hat = phi + np.arange(6) * 1e-5
        velocities = [(v_hat[:4] * correction).reshape(2, 2),
                      v_hat[4:] * correction]
        stats = study_moments.moment_statistics(
            velocities, steps=steps, beta_2=beta_2, phi=phi, gamma=2.5e-5)
        self.assertAlmostEqual(stats["median_vc_over_phi"], 0.25)
        self.assertAlmostEqual(stats["mean_vc_over_phi"], 0.25)
        self.assertAlmostEqual(stats["below_gamma"], 0.5)  # 0, 1, 2 of 6.
        no_gamma = study_moments.moment_statistics(
            velocities, steps=steps, beta_2=beta_2, phi=phi)
        self.assertNotIn("below_gamma", no_gamma)


if __name__ == "__main__":
    absltest.main()
