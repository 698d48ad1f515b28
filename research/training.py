"""The examples' one DP training loop: Poisson batches, resume, metrics.

`train_private` trains `make_private(model_fn())` for the steps of a
`common.TrainConfig` and returns the trained model with its results; the
binaries call `fit_private` (the results only), the diagnostics binary calls
`train_private` with `diagnostics=True` and its own callbacks.

Keras shows a live progress bar with epsilon on a terminal and one line per
evaluation interval (a Keras epoch of `eval_every` steps) in a log; the last
interval is as long as the steps left (`fit_segments`), so its line counts
the steps that ran, and every `Epoch k/N` counts to the run's last epoch N,
across `fit` calls and resumes (`tf_dpadam.run_dir.ProgressBar`).

With `config.ema` the optimizer keeps a moving average of the weights
(Keras' `use_ema`). Training always runs on the raw weights, over any number
of `fit` calls and resumes (`AveragedEvaluation` undoes Keras' end-of-fit
overwrite); the evaluations (the curve's val_* metrics, the final test
metrics) and the returned model use the average; the checkpoint keeps the raw
weights, with the average in the optimizer's state.

With a validation split (`config.validation_examples` = V > 0, the
binaries' --validation_examples) `train` holds the N - V training examples
left after it, whose number the accounting counts, and the final evaluation
also covers the V held out (`validation_accuracy`, `validation_loss` in the
results and metrics.json), by which the studies select learning rates; the
curve (Keras' val_* metrics) stays on the test set, reported only.

A `model_dir` (issue 34) is kept by `tf_dpadam.run_dir`: held by one process
at a time (`hold`: a lock, and a writable folder, checked before any step),
checkpoints written whole (`save_checkpoint`: a temporary file renamed over
the checkpoint, the one before kept as `checkpoint.prev.keras`), so a kill at
any moment leaves one that loads; a damaged one is reported and the earlier
one used (`load_checkpoint`). The model's privacy ledger (every checkpoint
carries it) counts the run's steps, those of killed processes after their
last checkpoint included (`ledger.json` reserves steps before they run); a
resume with other privacy settings, or whose checkpoint and `ledger.json`
disagree, is refused before any step (`begin_ledger`), and the epsilon
reported is the composition of the model's ledger. A resume keeps the
checkpoint's learning rate unless `train_private` is given one (the
binaries' --learning_rate, `run_dir.resumed`).
"""

import functools
import math
import os
import sys
import time

from absl import logging
import keras
import tensorflow as tf

import tf_dpadam
from tf_dpadam.tools import run_dir as run_dir_lib
from research import common
from research import datasets
from research import record_sources
from research import runs


def poisson_plan(config, train, first_step=0):
    """`(N, T, batches)`: the examples, the steps and their Poisson batches.

    `train` is `(x, y)` arrays, or a `record_sources.RecordSource` read by
    random access (only the sampled records of each step). `first_step`:
    the steps a resumed run has taken (its batches continue, never replay,
    theirs; with `config.noise_bands` = b > 1 a multiple of b, and the
    batches cyclic Poisson ones over b groups, from arrays or by random
    access).
    """
    bands = config.noise_bands
    cyclic = {}
    if bands > 1:
        # Cyclic Poisson batches of b groups: step t of the run samples
        # group t mod b (the passes, of `eval_every` rounded up to whole
        # cycles, and the resumes, at a multiple of b, keep the cycle).
        cyclic = dict(groups=bands, group_offset=first_step)
    if isinstance(train, record_sources.RecordSource):
        num_examples = len(train)
        make_batches = functools.partial(
            tf_dpadam.data.poisson_batches_from_source, train.source,
            decode=train.decode, **cyclic)
    else:
        num_examples = len(train[1])
        make_batches = functools.partial(tf_dpadam.data.poisson_batches,
                                         train, **cyclic)
    steps = common.total_steps(config, num_examples)  # Before any pipeline.
    batches = make_batches(
        expected_batch_size=config.batch_size,
        physical_batch_size=config.physical_batch_size,
        steps_per_epoch=eval_interval(config),
        seed=config.noise_seed,
        first_step=first_step,
        # Graphs take each batch at about its size (0.7x the step time of
        # static padding on Fashion-MNIST); XLA compiles once per shape, so
        # it gets the static padded batches.
        pad_to_multiple_of=None if config.jit_compile else 32,
    )
    if isinstance(train, record_sources.RecordSource) and train.transform:
        # Example by example: a map of whole padded batches is refused.
        batches = batches.map_examples(
            lambda x, y: train.transform(x, y, None)[:2])
    return num_examples, steps, batches


# Settings that cannot train on this data (e.g. a budget below one step, a
# batch larger than the data) or in this model_dir: a usage error of the
# binaries.
SettingsError = run_dir_lib.SettingsError


def eval_interval(config):
    """The steps between evaluations: `config.eval_every`, rounded up to a
    multiple of `config.noise_bands` (every `fit` of correlated noise
    takes whole cycles of its b groups)."""
    return common.bands_steps(config.eval_every, config.noise_bands, up=True)


def _plan(config, train, first_step):
    """`poisson_plan`; `SettingsError` if `config` cannot train on
    `train`."""
    try:
        return poisson_plan(config, train, first_step=first_step)
    except ValueError as error:
        raise SettingsError(str(error)) from error


def fit_segments(done, steps, eval_every):
    """The `model.fit` calls that take the steps `done + 1 ... steps`.

    Every epoch ends at a multiple of `eval_every` (an evaluation) or at
    `steps`, so it is as long as the steps it takes: Keras' progress bar
    then counts them (a stopped epoch would show its full length). Keras
    has one `steps_per_epoch` per `fit`, so epochs of another length need a
    `fit` of their own.

    Returns:
        A list of `(initial_epoch, epochs, steps_per_epoch)` in logical
        steps, e.g. `[(0, 7, 100), (7, 8, 19)]` for 719 steps by 100.
    """
    segments = []
    step = done
    while step < steps:
        epoch = step // eval_every
        length = min((epoch + 1) * eval_every, steps) - step
        if segments and segments[-1][1:] == (epoch, length):
            segments[-1] = (segments[-1][0], epoch + 1, length)
        else:
            segments.append((epoch, epoch + 1, length))
        step += length
    return segments


def progress_verbosity():
    """Keras' `verbose`: 1 (a live bar) on a terminal, 2 (a line per epoch)
    in a log or a pipe."""
    return 1 if sys.stdout.isatty() else 2


def tensorboard_callbacks(log_dir):
    """TensorBoard logs in `log_dir`: every DP step's loss, accuracy and
    epsilon (`batch_*`, `StepSummaries`) and every evaluation's (`epoch_*`
    and the validation metrics, Keras' `TensorBoard`). Put them after
    `tf_dpadam.PrivacyBudget`, which adds epsilon to the logs."""
    return [keras.callbacks.TensorBoard(log_dir, write_graph=False),
            StepSummaries(os.path.join(log_dir, "train"))]


def model_steps(model):
    """The logical steps a private model took: its privacy ledger's (across
    `fit` calls and resumes, a killed process's lost steps included; not
    its optimizer's)."""
    return model.privacy_ledger.steps


class StepSummaries(keras.callbacks.Callback):
    """Writes the batch logs (loss, accuracy, epsilon, ...) as TensorBoard
    scalars `batch_<name>` at each DP step, numbered by `model_steps`:
    across `fit` calls and resumes, and once per logical step under
    gradient accumulation (Keras' TensorBoard numbers physical batches from
    1 at every `fit`)."""

    def __init__(self, log_dir):
        super().__init__()
        self.log_dir = log_dir
        self._writer = None
        self._step = None

    def on_train_begin(self, logs=None):
        if self._writer is None:
            self._writer = tf.summary.create_file_writer(self.log_dir)

    def on_train_batch_end(self, batch, logs=None):
        step = model_steps(self.model)
        if step == self._step or not logs:
            return  # A micro-batch of an accumulated step.
        self._step = step
        with self._writer.as_default():
            for name, value in logs.items():
                tf.summary.scalar(f"batch_{name}", value, step=step)

    def on_train_end(self, logs=None):
        self._writer.flush()


class StepLog(keras.callbacks.Callback):
    """Records the logical step, test metrics and epsilon per evaluation."""

    def __init__(self):
        super().__init__()
        self.rows = []

    def on_epoch_end(self, epoch, logs=None):
        row = {"step": model_steps(self.model)}
        row.update({k: float(v) for k, v in (logs or {}).items()})
        self.rows.append(row)


class StopAtStep(keras.callbacks.Callback):
    """Stops training once the model has taken `steps` steps
    (`model_steps`)."""

    def __init__(self, steps):
        super().__init__()
        self.steps = steps

    def on_train_batch_end(self, batch, logs=None):
        if model_steps(self.model) >= self.steps:
            self.model.stop_training = True


class RunProgress(keras.callbacks.Callback):
    """Keeps a run's wall time and curve across resumes.

    At every epoch's end (after the checkpoint and `step_log`) writes to
    `path` (`runs.ELAPSED` of the model_dir; None: nothing is written) the
    seconds spent so far, this session's and those of the sessions before
    (`seconds_before`), and the curve so far (`curve()`: the evaluations of
    the sessions before, `rows_before`, up to this session's first, then
    this session's). So a run killed between checkpoints and resumed loses
    neither its time nor its earlier evaluations.
    """

    def __init__(self, path, step_log, seconds_before=0.0, rows_before=()):
        super().__init__()
        self.path = path
        self.step_log = step_log
        self.seconds_before = seconds_before
        self.rows_before = list(rows_before)
        self.start = time.time()

    def seconds(self):
        return self.seconds_before + time.time() - self.start

    def curve(self):
        rows = self.step_log.rows
        first = rows[0]["step"] if rows else float("inf")
        return [r for r in self.rows_before if r["step"] < first] + rows

    def on_epoch_end(self, epoch, logs=None):
        if self.path is not None:
            runs.write_json(self.path, {"wall_seconds": self.seconds(),
                                        "history": self.curve()})


class AveragedEvaluation(keras.callbacks.Callback):
    """Trains on the raw weights, evaluates on the optimizer's average.

    For an optimizer with `use_ema`. Keras' `fit` ends by overwriting the
    model's weights with their average (`finalize_variable_values`); over
    several `fit` calls (segments, resumes) the training would go on from
    the average. This callback keeps a copy of the raw weights at every
    epoch's end and puts it back when `fit` ends, and puts the average in
    for each evaluation (`on_test_begin`, e.g. fit's validation) and the raw
    weights back after it. Both are exact copies, held in host memory
    (Keras' `SwapEMAWeights` swaps by arithmetic, which rounds the raw
    weights).
    """

    def __init__(self):
        super().__init__()
        self._raw = None

    def _keep_raw(self):
        self._raw = [keras.ops.convert_to_numpy(v)
                     for v in self.model.trainable_weights]

    def _restore_raw(self):
        for variable, value in zip(self.model.trainable_weights, self._raw):
            variable.assign(value)

    def on_train_begin(self, logs=None):
        self._keep_raw()

    def on_epoch_end(self, epoch, logs=None):
        self._keep_raw()

    def on_train_end(self, logs=None):
        self._restore_raw()

    def on_test_begin(self, logs=None):
        self._keep_raw()
        self.model.optimizer.finalize_variable_values(
            self.model.trainable_weights)

    def on_test_end(self, logs=None):
        self._restore_raw()


def _check_checkpoint(model, config):
    """Raises `SettingsError` if a checkpoint's private `model` decays or
    averages the weights, or augments the examples, otherwise than `config`
    says."""
    optimizer = model.optimizer
    saved = (optimizer.weight_decay or 0.0, optimizer.use_ema,
             optimizer.ema_momentum if optimizer.use_ema else None,
             model.augmult)
    wanted = (config.weight_decay, config.ema,
              config.ema_momentum if config.ema else None,
              max(config.augmult, 1))
    if saved != wanted:
        raise SettingsError(
            "The checkpoint in --model_dir was trained with (weight_decay,"
            f" ema, ema_momentum, augmult) = {saved}, not {wanted}; use"
            " another --model_dir.")


def compile_private(model, config, loss, accumulation_steps):
    """Compiles a private model with `config`'s optimizer and accuracy.

    The accuracy is a weighted metric, so that the padding rows of Poisson
    batches (sample weight 0) are not counted.
    """
    model.compile(
        optimizer=common.make_optimizer(config, accumulation_steps),
        loss=loss,
        weighted_metrics=["accuracy"],
        jit_compile=config.jit_compile,
    )


# ---------------------------------------------------------------------------
# The run directory (--model_dir): `tf_dpadam.run_dir` holds it for one
# process at a time, writes whole checkpoints and keeps the privacy ledger.

# How epsilon is computed (recorded, not a setting of the training: a run
# is accounted with the current one, as a whole).
ACCOUNTANT = common.ACCOUNTANT


def privacy_settings(config, num_examples, accumulation_steps):
    """`tf_dpadam.run_dir.privacy_settings` of a `common.TrainConfig`."""
    return run_dir_lib.privacy_settings(
        noise_multiplier=config.noise_multiplier,
        l2_norm_clip=config.l2_norm_clip, batch_size=config.batch_size,
        num_examples=num_examples, optimizer=config.optimizer,
        physical_batch_size=config.physical_batch_size,
        accumulation_steps=accumulation_steps, delta=config.delta,
        accountant=ACCOUNTANT, noise_bands=config.noise_bands)


def train_private(model_fn, train, test, config, loss, *, diagnostics=False,
                  callbacks=(), validate=True, max_steps=None, verbose=None,
                  augment=None, measure=None, count_all_steps=False,
                  learning_rate=None, validation=None):
    """Trains `make_private(model_fn())` with Poisson batches; resumes.

    Args:
        model_fn: builds the (non-private) Keras model.
        train: `(x, y)` NumPy arrays (x may be a dict of arrays), or a
            `record_sources.RecordSource` (random access, for data larger than
            memory).
        test: `(x, y)` for evaluation.
        config: a `common.TrainConfig`; with a `model_dir`, a checkpoint
            there is resumed and metrics.json written.
        validation: `(x, y)`, the `config.validation_examples` examples
            held out of the training set (`datasets.split_validation`;
            None when it is 0), evaluated once at the end beside `test`
            (`validation_accuracy`, `validation_loss`), for the selection
            of learning rates; `train` holds the others, whose number is
            the N of the accounting. The curve stays on `test`.
        loss: the Keras loss.
        diagnostics: `make_private(..., diagnostics=True)` (NOT private: it
            keeps the clean gradient; for `tf_dpadam.MomentDiagnostics`).
        callbacks: more Keras callbacks.
        validate: evaluate on `test` at every evaluation step (the curve);
            the final evaluation happens either way.
        max_steps: stop after this many steps if the config plans more (a
            smoke test; the results are those of the steps taken).
        verbose: Keras' verbosity (None: `progress_verbosity()`).
        augment: with `config.augmult` = K > 0, `make_private`'s
            augmentation multiplicity: each example's gradient is the mean
            over K views made by `augment`, clipped once (ε is unchanged).
        count_all_steps: resume a model_dir whose checkpoint and ledger
            disagree, counting the steps of both
            (`run_dir.begin_ledger`'s, --resume_counting_all_steps).
        learning_rate: the learning rate a resumed checkpoint's optimizer
            takes (`run_dir.resume_learning_rate`, e.g. --learning_rate);
            None: the checkpoint's. A new model takes `config`'s.
        measure: optional `f(model) -> dict` of more results, measured on
            the trained private model (e.g. `final_moments`'s statistics of
            the optimizer's state); stored with the results and in
            metrics.json.

    Returns:
        `(model, batches, results)`: the trained private model (with
        `config.ema`, holding the averaged weights, on which the test
        metrics and the curve's val_* metrics were measured; the checkpoint
        keeps the raw ones), the `tf_dpadam.data.poisson_batches` it
        trained on, and a dict of results (config, steps, epsilon, test
        metrics, with `validation` its metrics too, wall time, curve).

    Raises:
        SettingsError: if the config cannot train on `train` (before any
            model is built), `validation` does not hold
            `config.validation_examples` examples, or a checkpoint in its
            model_dir decays or averages the weights otherwise.
    """
    _check_validation(validation, config)
    keras.utils.set_random_seed(config.seed)
    with run_dir_lib.resumed(config.model_dir, learning_rate) as model:
        return _train_private(model, model_fn, train, test, config, loss,
                              diagnostics=diagnostics, callbacks=callbacks,
                              validate=validate, max_steps=max_steps,
                              verbose=verbose, augment=augment,
                              measure=measure,
                              count_all_steps=count_all_steps,
                              validation=validation)


def split_validation(x, y, config):
    """`datasets.split_validation(x, y, config.validation_examples)` of a
    binary's training set, `((x_train, y_train), validation)`;
    `SettingsError` for a split that leaves no example to train on."""
    try:
        return datasets.split_validation(x, y, config.validation_examples)
    except ValueError as error:
        raise SettingsError(str(error)) from error


def _check_validation(validation, config):
    """Raises `SettingsError` unless `validation` holds exactly
    `config.validation_examples` examples (None for 0): the run's record
    says how many examples it held out, and a binary that holds out none
    cannot take the setting."""
    held_out = 0 if validation is None else len(validation[1])
    if held_out != config.validation_examples:
        raise SettingsError(
            f"Expected a validation split of --validation_examples="
            f"{config.validation_examples} examples, got {held_out}"
            + ("" if validation is not None else
               " (this data path holds none out)") + ".")


def _train_private(model, model_fn, train, test, config, loss, *,
                   diagnostics, callbacks, validate, max_steps, verbose,
                   augment, measure, count_all_steps=False, validation=None):
    """`train_private`, with its model_dir held: `model` is its checkpoint's
    (None: none, or no model_dir; `run_dir_lib.resumed`)."""
    model_dir = config.model_dir
    bands = config.noise_bands
    # A resumed run's batches continue the run's, never replay them (with
    # correlated noise from a multiple of b: whole cycles of the groups).
    done = 0 if model is None else common.bands_steps(model_steps(model),
                                                      bands, up=True)
    num_examples, steps, batches = _plan(config, train, done)
    if max_steps is not None:
        steps = min(steps, common.bands_steps(max_steps, bands))
    every = eval_interval(config)
    k = batches.accumulation_steps
    if model is None:
        model = tf_dpadam.make_private(model_fn(), seed=config.noise_seed,
                                       diagnostics=diagnostics,
                                       augment=augment,
                                       augmult=max(config.augmult, 1))
        compile_private(model, config, loss, k)
    else:
        _check_checkpoint(model, config)
    ledger = None
    if model_dir:
        # Before any step: the settings of the run, and this process's
        # segment of its ledger.
        ledger = run_dir_lib.begin_ledger(
            model_dir, privacy_settings(config, num_examples, k), model,
            count_all_steps=count_all_steps)
        if model_steps(model) != done:  # With the steps a kill lost.
            done = common.bands_steps(model_steps(model), bands, up=True)
            batches = _plan(config, train, done)[2]
    # With b > 1 a resume after a kill starts the plan at the next whole
    # cycle: the steps up to it that the kill did not take are never taken,
    # and the run ends short of `steps` by as many (its planned steps).
    skipped = done - model_steps(model)
    if skipped:
        logging.info("Resuming at step %d of the plan, a whole cycle of the"
                     " %d groups: the run takes %d steps fewer than %d.",
                     done, bands, skipped, steps)
    budget = tf_dpadam.PrivacyBudget(
        num_examples=num_examples,
        accountant=ACCOUNTANT,
        delta=config.delta,
        target_epsilon=config.target_epsilon,
    )
    step_log = StepLog()
    callbacks = [budget, step_log, *callbacks]
    if config.ema:
        callbacks.insert(0, AveragedEvaluation())
    if model_dir:
        callbacks.append(run_dir_lib.AtomicCheckpoint(model_dir, ledger))
        # After the checkpoint: a resume adds the time and curve up to it.
        progress = RunProgress(
            os.path.join(model_dir, runs.ELAPSED), step_log,
            *(runs.progress_before(model_dir) if done else ()))
        callbacks.append(progress)
    else:
        progress = RunProgress(None, step_log)
    # Last (after PrivacyBudget's epsilon), replacing Keras' bar.
    callbacks.append(run_dir_lib.ProgressBar(math.ceil(steps / every)))
    for initial_epoch, epochs, length in fit_segments(done, steps, every):
        model.fit(
            batches.dataset.repeat(),
            steps_per_epoch=length * k,
            shuffle=False,  # The batches are Poisson samples already.
            epochs=epochs,
            initial_epoch=initial_epoch,
            validation_data=test if validate else None,
            validation_batch_size=512,
            callbacks=callbacks,
            verbose=progress_verbosity() if verbose is None else verbose,
        )
        if model.stop_training:
            break  # A callback stopped training (e.g. StopAtStep).
    # With a model_dir, the sessions before a resume count too.
    wall = progress.seconds()
    # With config.ema: the average in the model, as Keras' fit leaves it.
    model.optimizer.finalize_variable_values(model.trainable_weights)
    test_loss, test_accuracy = model.evaluate(*test, batch_size=512, verbose=0)
    held_out = {}
    if validation is not None:
        # The held-out training examples, for the selection of learning
        # rates (the test set only reports).
        validation_loss, validation_accuracy = model.evaluate(
            *validation, batch_size=512, verbose=0)
        held_out = {"validation_accuracy": float(validation_accuracy),
                    "validation_loss": float(validation_loss)}
    steps_done = model_steps(model)
    # Every step the model took, each with the mechanism it ran (its
    # ledger, which a model_dir's checkpoints carry across resumes).
    epsilon = (model.spent_epsilon(config.delta, ACCOUNTANT) if ledger is None
               else ledger.epsilon())
    results = {
        "config": common.config_record(config),
        "num_examples": num_examples,
        "steps": steps_done,
        "planned_steps": steps - skipped,
        "epsilon": epsilon,
        "delta": config.delta,
        "test_accuracy": float(test_accuracy),
        "test_loss": float(test_loss),
        **held_out,
        "wall_seconds": wall,
        "history": progress.curve(),
    }
    if measure is not None:
        results.update(measure(model))
    if ledger is not None:
        results["ledger"] = model.privacy_ledger.to_json()
        runs.write_json(os.path.join(model_dir, runs.METRICS), results)
    return model, batches, results


def fit_private(model_fn, train, test, config, loss, on_trained=None,
                **kwargs):
    """`train_private`'s results (also in model_dir/metrics.json).

    Args:
        model_fn, train, test, config, loss: as for `train_private`.
        on_trained: optional `f(model)` called with the trained private
            model (the checkpoint's, after a resume; with `config.ema`
            holding the averaged weights) before returning.
        **kwargs: `train_private`'s `callbacks`, `max_steps`, `verbose`,
            `augment`, `measure`, `count_all_steps`, `learning_rate`,
            `validation`.
    """
    model, _, results = train_private(model_fn, train, test, config, loss,
                                      **kwargs)
    if on_trained is not None:
        on_trained(model)
    return results
