"""The secret state of correlated noise: one private model's noise history.

With a banded strategy of b > 1 bands (`tf_dpadam.privatizer.
correlated_noise`), step t's noise is computed from its own independent
draw and the last b - 1 steps' noise. `NoiseHistory` holds those b - 1
noise tensors per trainable variable, the strategy's public impulse
response and the count of draws, in TensorFlow variables that a private
model keeps out of sight of Keras' and TensorFlow's tracking (as its noise
seeds): never in `model.weights`, a `.keras` file or a checkpoint, since
the past noise and the released weights together would reveal the past
clean gradients.

A run resumes its noise stream from `to_numpy()`'s values, which
`tf_dpadam.tools.run_dir` writes beside each checkpoint (`NOISE_STATE`,
readable by the owner only) and restores with it (`restore`). Without
them, or for values that belong to another checkpoint, the history
starts again at zero: the noise matrix becomes block diagonal, each block
a banded strategy whose columns have norm at most 1, which is as private
(each block is its own segments of the ledger) and only loses the
correlation across the restart. A resume whose optimizer has another
strategy than the saved state's is refused: that is a different
mechanism, not a continuation. An in-process recompile with another
strategy starts a new history (a new block).
"""

import numpy as np
import tensorflow as tf
from absl import logging

from tf_dpadam.privatizer import correlated_noise


class NoiseHistory:
    """A private model's correlated-noise state (see the module).

    Attributes:
        strategy: the `BandedToeplitz` of the current history (None before
            the first banded step).
    """

    def __init__(self):
        self.strategy = None
        self._shapes = None
        self._variables = None  # (history tuple, impulse, variance, draws)
        self._pending = None  # A restored state, for the next `state`.
        # The model's `tf.distribute` strategy (`draws_for`), whose replicas
        # each read a copy of the history (`_new_variable`).
        self._distribute = None

    @property
    def draws(self) -> int:
        """The logical steps drawn with the current history (0 if none; a
        restored state's count before its first step)."""
        if self._pending is not None:
            return int(np.asarray(self._pending["draws"]))
        if self._variables is None:
            return 0
        return int(self._variables[3].numpy())

    def draws_for(self, strategy, shapes=None, distribute=None) -> int:
        """The steps of the history that the next banded step of `strategy`
        continues (0 for a new one, or without `strategy`): the history is
        made now (eagerly) where `shapes` are known, so that it does not
        start again in the step's trace after the batches are aligned with
        this count.

        `distribute`: the model's `tf.distribute` strategy (None: the
        current one), under which the history's variables are made.

        Raises:
            ValueError: a restored state has another strategy.
        """
        if distribute is not None:
            self._distribute = distribute
        if strategy is None or strategy.bands == 1:
            return 0
        if shapes is None:
            return self.draws if self.strategy in (None, strategy) else 0
        self._make(strategy, shapes)
        return self.draws

    def state(self, strategy, shapes) -> correlated_noise.NoiseState:
        """The `NoiseState` for `strategy` and noise tensors of `shapes`,
        creating its variables (outside any trace) on first use and
        anew when the strategy or the shapes change.

        Raises:
            ValueError: a restored state has another strategy.
        """
        self._make(strategy, shapes)
        history, impulse, variance, draws = self._variables
        return correlated_noise.NoiseState(
            tuple(h.read_value() for h in history), impulse.read_value(),
            variance.read_value(), draws.read_value())

    def _make(self, strategy, shapes):
        """Makes the variables for `strategy` and `shapes` unless they are
        (with a restored state's values, `restore`), reading none."""
        shapes = tuple(tuple(int(d) for d in shape) for shape in shapes)
        pending = self._pending
        if pending is not None and pending["strategy"] != strategy:
            raise ValueError(
                "Expected the resumed run's noise_strategy to be the one its"
                f" noise state was saved with, {pending['strategy']!r}; got"
                f" {strategy!r}. Another strategy is another mechanism:"
                " start a new run (or a new run folder) to change it.")
        if self.strategy != strategy or self._shapes != shapes:
            if self._variables is not None:
                logging.info("Correlated noise: the noise strategy or the"
                             " weights changed; the noise history starts"
                             " again at zero.")
            with tf.init_scope():
                initial = correlated_noise.initial_state(strategy, shapes)
                self._variables = (
                    tuple(self._new_variable(h) for h in initial.history),
                    self._new_variable(initial.impulse),
                    self._new_variable(initial.variance),
                    self._new_variable(initial.draws))
                if pending is not None:
                    self._assign_numpy(pending, shapes)
            self.strategy, self._shapes = strategy, shapes
        self._pending = None

    def _new_variable(self, value):
        """A variable of the history. Under `tf.distribute` replicas, one
        copy per replica (each reads its own) that an assignment in a
        replica's step sets from the first replica's value, the one whose
        noise the step adds (`replicas.first_replica_share`); in
        cross-replica context (accumulation) it sets them all."""
        distribute = self._distribute or tf.distribute.get_strategy()
        if distribute.num_replicas_in_sync == 1:
            return tf.Variable(value, trainable=False)
        with distribute.scope():
            return tf.Variable(
                value, trainable=False,
                synchronization=tf.VariableSynchronization.ON_WRITE,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)

    def assign(self, state: correlated_noise.NoiseState) -> None:
        """Stores the state after a draw (in the step's graph)."""
        history, impulse, variance, draws = self._variables
        for variable, value in zip(history, state.history):
            variable.assign(value)
        impulse.assign(state.impulse)
        variance.assign(state.variance)
        draws.assign(state.draws)

    def to_numpy(self) -> dict | None:
        """The state as NumPy arrays and the strategy's config (SECRET:
        the past noise), or None before the first banded step."""
        if self._variables is None:
            return None
        history, impulse, variance, draws = self._variables
        values = {f"history_{i}": h.numpy() for i, h in enumerate(history)}
        values.update(impulse=impulse.numpy(), variance=variance.numpy(),
                      draws=draws.numpy(),
                      coefficients=np.asarray(self.strategy.coefficients),
                      name=np.asarray(self.strategy.name))
        return values

    def restore(self, values: dict) -> None:
        """Continues the noise stream from `to_numpy()`'s `values` (the
        next banded step checks the strategy and the shapes)."""
        strategy = correlated_noise.BandedToeplitz(
            tuple(float(c) for c in np.asarray(values["coefficients"])),
            str(np.asarray(values["name"])))
        self._pending = dict(values, strategy=strategy)
        self.strategy, self._shapes, self._variables = None, None, None

    def _assign_numpy(self, values, shapes):
        history, impulse, variance, draws = self._variables
        saved = [np.asarray(values[key]) for key in sorted(
            (k for k in values if k.startswith("history_")),
            key=lambda k: int(k.split("_")[1]))]
        if len(saved) != len(history) or any(
                s.shape != tuple(h.shape) for s, h in zip(saved, history)):
            logging.warning(
                "Correlated noise: the saved noise state does not fit the"
                " model's weights %s; the noise history starts again at"
                " zero.", shapes)
            return
        for variable, value in zip(history, saved):
            variable.assign(value)
        impulse.assign(np.asarray(values["impulse"]))
        variance.assign(np.asarray(values["variance"]))
        draws.assign(np.asarray(values["draws"]))
