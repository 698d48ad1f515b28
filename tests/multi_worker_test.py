"""MultiWorkerMirroredStrategy: two worker processes on localhost.

`multi_worker_check.py` runs as both workers (TF_CONFIG with two free
ports, one CPU replica each); each prints its results as JSON. One pair of
workers computes everything the tests below read.
"""

import json
import os
import socket
import subprocess
import sys

import numpy as np
import pytest
from absl.testing import absltest

pytestmark = pytest.mark.slow  # Two worker processes.

_WORKERS = 2


def _free_ports(count):
    sockets = [socket.socket() for _ in range(count)]
    for s in sockets:
        s.bind(("localhost", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _max_difference(a, b):
    return max(float(np.max(np.abs(np.array(x) - np.array(y))))
               for x, y in zip(a, b))


class MultiWorkerTest(absltest.TestCase):

    @classmethod
    def setUpClass(cls):
        super().setUpClass()
        script = os.path.join(os.path.dirname(__file__),
                              "multi_worker_check.py")
        ports = [str(p) for p in _free_ports(_WORKERS)]
        workers = [
            subprocess.Popen(
                [sys.executable, script, str(index)] + ports,
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            )
            for index in range(_WORKERS)
        ]
        cls.results = []
        try:
            outputs = [w.communicate(timeout=300) for w in workers]
        finally:
            for w in workers:
                if w.poll() is None:
                    w.kill()
        for worker, (stdout, stderr) in zip(workers, outputs):
            lines = [l for l in stdout.splitlines() if l.startswith("RESULT ")]
            if not lines:
                raise AssertionError(
                    f"multi_worker_check.py failed ({worker.returncode}):\n"
                    + stderr[-5000:]
                )
            cls.results.append(json.loads(lines[-1][len("RESULT "):]))

    def test_two_workers_of_one_replica_each(self):
        self.assertEqual([r["worker"] for r in self.results], [0, 1])
        self.assertEqual([r["replicas"] for r in self.results], [2, 2])

    def test_a_step_on_two_workers_is_the_single_process_step(self):
        # 4 noise-free DPAdamCorrected steps of 16 examples (8 per worker),
        # clipping active, B counted over both workers: float rounding only.
        first, second = self.results
        np.testing.assert_allclose(
            _max_difference(first["single"], first["distributed"]), 0.0,
            atol=1e-6,
        )
        self.assertEqual(first["distributed"], second["distributed"])

    def test_noise_is_added_once_in_total(self):
        sigma, clip, batch = 1.3, 0.5, 32
        expected = sigma * clip / batch
        first, second = self.results
        stats = first["noise"]
        # 102,400 coordinates: the sample std has relative standard error
        # 1/sqrt(2n) = 0.22%; 1.5% is ~7 of them. Noise from each worker
        # would give sqrt(2) = 1.41x, noise divided by the workers 0.5x.
        self.assertAlmostEqual(stats["std"] / expected, 1.0, delta=0.015)
        # Phi from the global B = 32 (each worker saw 16).
        self.assertAlmostEqual(stats["phi"] / expected**2, 1.0, places=5)
        # Each worker drew its own secret noise key, and both applied the
        # same update: the noise reached them through the all-reduce.
        self.assertEqual(stats["checksum"], second["noise"]["checksum"])

    def test_sharded_poisson_steps_are_the_union_on_one_process(self):
        # Each worker samples its shard with k = 2 micro-batches per logical
        # step (accumulated on the replicas); one process applies each
        # step's union of the two samples as one batch with the same noise
        # seed: the same weights up to float rounding.
        first, second = self.results
        sharded = first["sharded"]
        self.assertEqual(sharded["workers"], 2)
        self.assertEqual(sharded["accumulation_steps"], 2)
        self.assertLess(
            _max_difference(sharded["single"], sharded["distributed"]), 1e-5
        )
        self.assertEqual(sharded["distributed"],
                         second["sharded"]["distributed"])

    def test_accounting_uses_the_global_n_and_b(self):
        for result in self.results:
            sharded = result["sharded"]
            # One optimizer step per logical step, not one per worker or
            # per micro-batch.
            self.assertEqual(sharded["iterations"], sharded["steps"])
            # PrivacyBudget(num_examples=N) on each worker: epsilon of
            # q = B / N = 20 / 200 for those steps.
            self.assertAlmostEqual(sharded["epsilon"],
                                   sharded["expected_epsilon"], places=12)


if __name__ == "__main__":
    absltest.main()
