"""The cost of a private model's privacy ledger (`tf_dpadam.training.model_ledger`).

    PYTHONPATH=. python benchmarks/ledger_cost.py

Prints, from one run:

(a) the paper CNN's DP step (`examples.train_image.make_cnn` on 28x28x1,
    B = 256, DPAdamCorrected with Fashion-MNIST's C and sigma, graph mode)
    with the ledger's step counter and with the counter's increment removed
    (the model's `ModelLedger.count_step` made a no-op before its train
    function is traced): the median step time of each and their ratio. The
    two models alternate one step at a time (their train functions called
    directly, as `fit` does), so that the load of a shared machine weighs
    on both alike: the estimate is the median of the ratios of each step
    to the other model's step next to it (with its quartiles). The CPU
    time of the process per step (all threads) is printed too: other
    processes inflate it less than the wall time. On a shared machine the
    steps' spread (their quartiles) is wider than 1%, so the increment's
    own cost is also measured apart: a traced function of 1,000
    `count_step`s against an empty one, per increment.
(b) the Python cost per step of the ledger at 10,000 steps: with a Poisson
    segment of 10,000 steps open (q = 256 / 60,000, sigma = 0.52), the time
    of what runs in Python around each step: `model.begin_ledger_segment()`
    (the train function's wrapper), reading `model.privacy_ledger`, and
    `PrivacyBudget.on_train_batch_end` (PLD, the default, in a fit of more
    than `pld_log_every` batches, so that the exact epsilon is computed
    every `pld_log_every` steps only), over the steps 10,001 to 11,000;
    the counter is incremented between them (untimed), as the train step
    does. Mean, median and the slowest step (a multiple of
    `pld_log_every`, where the exact epsilon is computed), each part's
    mean and median, and `on_train_begin`, which computes the epsilon of
    10,000 steps from nothing.

The goals: the ledger costs at most 1% of a step (a), and at most 1 ms of
Python per step (b).
"""

import os
import resource
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # Before TensorFlow.

import keras  # pylint: disable=g-import-not-at-top
import numpy as np
import tensorflow as tf

import tf_dpadam
from examples import train_image
from tf_dpadam.training import model_ledger
from tf_dpadam.accounting import plans

BATCH = 256
NUM_EXAMPLES = 60_000  # Fashion-MNIST's training set.
PAPER = train_image.PAPER["fashion_mnist"]
WARMUP = 3  # Untimed steps of each model (tracing).
PAIRS = 48  # Timed steps of each model, alternating one step at a time.
LEDGER_STEPS = 10_000
TIMED_LEDGER_STEPS = 1_000
DELTA = 1e-5


def _cpu_seconds():
    """CPU time of this process so far (all threads, user + system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _private_cnn(counting):
    keras.utils.set_random_seed(0)
    model = tf_dpadam.make_private(
        train_image.make_cnn((28, 28, 1), 10), seed=0)
    if not counting:
        # Before the train function is traced: the step then has no
        # increment of the counter at all.
        model._model_ledger.count_step = lambda: None  # pylint: disable=protected-access
    model.compile(
        optimizer=tf_dpadam.DPAdamCorrected(
            l2_norm_clip=PAPER["l2_norm_clip"],
            noise_multiplier=PAPER["noise_multiplier"], batch_size=BATCH,
            learning_rate=train_image.LEARNING_RATES["dpadam_corrected"]),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False)
    return model


def _one_step(model, iterator):
    """Wall and CPU seconds of one call of the model's train function (one
    step; its loss read back, so that the step has finished)."""
    cpu, start = _cpu_seconds(), time.perf_counter()
    logs = model.train_function(iterator)
    float(logs["loss"])
    return time.perf_counter() - start, _cpu_seconds() - cpu


def _quartiles(values):
    low, middle, high = statistics.quantiles(values, n=4)
    return f"{middle:.4f} (quartiles {low:.4f}, {high:.4f})"


def increment_cost(increments=1000, calls=20, repeats=7):
    """Seconds of one `ModelLedger.count_step` in a traced function: a
    function of `increments` increments against an empty one (the best of
    `repeats` timings of `calls` calls each), per increment."""
    ledger = model_ledger.ModelLedger()

    @tf.function
    def counting():
        for _ in range(increments):
            ledger.count_step()
        return tf.constant(0)

    @tf.function
    def empty():
        return tf.constant(0)

    seconds = {}
    for name, function in (("counting", counting), ("empty", empty)):
        function()  # Traced.
        best = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(calls):
                function()
            best.append(time.perf_counter() - start)
        seconds[name] = min(best) / calls
    return (seconds["counting"] - seconds["empty"]) / increments


def step_ratio():
    """(a): the step with the counter over the step without it."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH, 28, 28, 1)).astype("float32")
    y = rng.integers(0, 10, BATCH)
    # One fixed batch of B rows, repeated: the same work at every step.
    dataset = tf.data.Dataset.from_tensors((x, y)).repeat()
    models = {True: _private_cnn(True), False: _private_cnn(False)}
    iterators = {}
    for counting, model in models.items():
        # Traces the train function (and checks independence) first.
        model.fit(dataset, steps_per_epoch=WARMUP, verbose=0)
        iterators[counting] = iter(
            model.distribute_strategy.experimental_distribute_dataset(
                dataset))
        _one_step(model, iterators[counting])
    counters = {c: m._model_ledger.counter for c, m in models.items()}  # pylint: disable=protected-access
    before = {c: int(v.numpy()) for c, v in counters.items()}
    wall = {True: [], False: []}
    cpu = {True: [], False: []}
    for pair in range(PAIRS):
        # One step of each, alternating which goes first.
        for counting in (True, False) if pair % 2 == 0 else (False, True):
            seconds, cpu_seconds = _one_step(models[counting],
                                             iterators[counting])
            wall[counting].append(seconds)
            cpu[counting].append(cpu_seconds)
    counted = {c: int(v.numpy()) - before[c] for c, v in counters.items()}
    if counted != {True: PAIRS, False: 0}:
        raise RuntimeError(f"Expected the counter to count the steps of the"
                           f" counting model only, got {counted}.")
    ratios = [a / b for a, b in zip(wall[True], wall[False])]
    cpu_ratios = [a / b for a, b in zip(cpu[True], cpu[False])]
    with_, without = (statistics.median(wall[c]) for c in (True, False))
    print(f"(a) paper CNN 28x28x1, B={BATCH}, DPAdamCorrected, graph mode:"
          f" {PAIRS} steps of each model, alternating one step at a time")
    print(f"    median step: {with_ * 1e3:.1f} ms with the counter,"
          f" {without * 1e3:.1f} ms without: ratio {with_ / without:.4f}")
    print(f"    CPU time per step: {statistics.mean(cpu[True]) * 1e3:.1f} ms"
          f" with, {statistics.mean(cpu[False]) * 1e3:.1f} ms without:"
          f" ratio {sum(cpu[True]) / sum(cpu[False]):.4f}")
    print(f"    paired ratios (each step over the other model's next to it):"
          f" wall {_quartiles(ratios)}; CPU {_quartiles(cpu_ratios)}")
    low = [statistics.quantiles(wall[c], n=4)[0] for c in (True, False)]
    print(f"    lower quartile of the steps (the least loaded):"
          f" {low[0] * 1e3:.1f} ms with, {low[1] * 1e3:.1f} ms without: ratio"
          f" {low[0] / low[1]:.4f}")
    ratio = statistics.median(ratios)
    print(f"    the counter's share of a step (median paired wall ratio):"
          f" {(ratio - 1) * 100:+.2f}% (goal: <= 1%; load average"
          f" {os.getloadavg()[0]:.1f})")
    increment = increment_cost()
    print(f"    the increment alone, in a traced function:"
          f" {increment * 1e6:.1f} us, {increment / without * 100:.4f}% of the step without it")
    return ratio


def python_cost():
    """(b): Python seconds per step of the ledger at `LEDGER_STEPS`."""
    keras.utils.set_random_seed(0)
    model = tf_dpadam.make_private(keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(2)]), seed=0)
    model.compile(
        optimizer=tf_dpadam.DPAdamCorrected(
            l2_norm_clip=1.0, noise_multiplier=PAPER["noise_multiplier"],
            batch_size=BATCH),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    steps_per_epoch = NUM_EXAMPLES // BATCH
    # As inside fit on Poisson batches of N = 60,000 (what
    # `SamplingFitMixin._fit_under_plan` records), 10,000 steps taken.
    model._fit_plan = plans.PoissonPlan(NUM_EXAMPLES, BATCH)  # pylint: disable=protected-access
    model.sampling_plan = model._fit_plan  # pylint: disable=protected-access
    model.begin_ledger_segment(new_segment=True)
    counter = model._model_ledger.counter  # pylint: disable=protected-access
    counter.assign_add(LEDGER_STEPS)
    budget = tf_dpadam.PrivacyBudget(delta=DELTA, verbose=0)
    budget.set_model(model)
    budget.set_params({"epochs": 100, "steps": steps_per_epoch,
                       "verbose": 0})
    start = time.perf_counter()
    budget.on_train_begin()
    begin = time.perf_counter() - start

    parts = ("begin_ledger_segment", "privacy_ledger", "on_train_batch_end")

    def one_step(batch):
        """The seconds of each part of the ledger's Python at one step."""
        times = [time.perf_counter()]
        model.begin_ledger_segment()
        times.append(time.perf_counter())
        ledger = model.privacy_ledger
        times.append(time.perf_counter())
        budget.on_train_batch_end(batch, logs={})
        times.append(time.perf_counter())
        return [b - a for a, b in zip(times, times[1:])], ledger

    first = sum(one_step(0)[0])
    each = []
    for batch in range(TIMED_LEDGER_STEPS):
        counter.assign_add(1)  # The train step's increment (untimed).
        seconds, ledger = one_step(batch + 1)
        each.append(seconds)
    if ledger.steps != LEDGER_STEPS + TIMED_LEDGER_STEPS:
        raise RuntimeError(f"Expected a ledger of"
                           f" {LEDGER_STEPS + TIMED_LEDGER_STEPS} steps, got"
                           f" {ledger.steps}.")
    times = [sum(seconds) for seconds in each]
    mean = statistics.mean(times)
    print(f"(b) Python cost of the ledger per step at {LEDGER_STEPS:,} steps"
          f" (Poisson q = {BATCH}/{NUM_EXAMPLES:,}, sigma ="
          f" {PAPER['noise_multiplier']}, PLD, pld_log_every ="
          f" {budget.pld_log_every}):")
    print(f"    PrivacyBudget.on_train_begin (epsilon of {LEDGER_STEPS:,}"
          f" steps): {begin * 1e3:.1f} ms; first batch end: {first * 1e3:.1f}"
          " ms")
    print(f"    begin_ledger_segment + privacy_ledger + on_train_batch_end,"
          f" steps {LEDGER_STEPS + 1:,} to"
          f" {LEDGER_STEPS + TIMED_LEDGER_STEPS:,}: mean {mean * 1e3:.3f} ms,"
          f" median {statistics.median(times) * 1e3:.3f} ms, slowest"
          f" {max(times) * 1e3:.1f} ms (goal: mean <= 1 ms; epsilon ="
          f" {budget.epsilon:.4f})")
    print("    by part, mean (median) ms: " + "; ".join(
        f"{name} {statistics.mean(column) * 1e3:.3f}"
        f" ({statistics.median(column) * 1e3:.3f})"
        for name, column in zip(parts, zip(*each))))
    return mean


def main():
    tf.get_logger().setLevel("ERROR")
    start = time.perf_counter()
    step_ratio()
    python_cost()
    print(f"({time.perf_counter() - start:.0f} s)")


if __name__ == "__main__":
    main()
