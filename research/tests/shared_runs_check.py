"""Child of experiments_test: one of two processes on the same plan.

Usage: shared_runs_check.py RUNS_DIR NAME

Runs `experiments.run_phase(plan, train_fn, "all")` on the plan of the
recorded runs (research_helpers.recorded_plan: 2 x 3 settings, seeds 0 and 1) in
RUNS_DIR, once a line arrives on its standard input (the parent starts both
processes first, then lets them go together), with a fake training that
takes 0.3 s and appends
"NAME <run folder>" to RUNS_DIR/trained.log, so that the parent can check
that the two processes shared the runs and trained each exactly once.
"""

import os
import sys
import time

from research import experiments

from research.tests import research_helpers


def main(argv):
    runs_dir, name = argv[1:]
    fake = research_helpers.fake_train_fn(
        lambda c: c.learning_rate * (1 + c.seed))

    def train_fn(config):
        time.sleep(0.3)
        with open(os.path.join(runs_dir, "trained.log"), "a") as log:
            log.write(f"{name} {os.path.basename(config.model_dir)}\n")
        return fake(config)

    print("ready", flush=True)
    sys.stdin.readline()
    experiments.run_phase(research_helpers.recorded_plan(runs_dir), train_fn, "all",
                          command="x", machine={})


if __name__ == "__main__":
    main(sys.argv)
