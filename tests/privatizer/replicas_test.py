"""Replicas (`tf_dpadam.privatizer.replicas`) without and with `tf.distribute`."""

import numpy as np
import tensorflow as tf
from absl.testing import absltest

from tf_dpadam.privatizer import replicas


class ReplicasTest(absltest.TestCase):

    def test_one_replica_is_the_identity(self):
        summed = [tf.constant([2.0, 4.0])]
        self.assertEqual(replicas.num_replicas(), 1)
        self.assertIs(replicas.replica_share(summed), summed)
        self.assertEqual(replicas.first_replica_share(), 1.0)
        self.assertIs(replicas.sum_over_replicas(summed), summed)

    def test_a_one_device_strategy_sums_and_shares(self):
        strategy = tf.distribute.MirroredStrategy(["/cpu:0"])

        def step():
            values = replicas.sum_over_replicas(tf.constant([1.0, 3.0]))
            share = replicas.replica_share([values])[0]
            return share * replicas.first_replica_share()

        result = strategy.run(tf.function(step))
        np.testing.assert_allclose(
            strategy.experimental_local_results(result)[0], [1.0, 3.0])


if __name__ == "__main__":
    absltest.main()
