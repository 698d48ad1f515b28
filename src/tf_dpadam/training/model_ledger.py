"""The privacy ledger a private model owns, and how its train step writes it.

`ModelLedger` keeps a `tf_dpadam.accounting.ledger.Ledger` of the closed
segments and one open segment (its `Mechanism`, its id, and the value of a
step counter when it opened). The counter is a `tf.Variable` that the train
step itself increments once per logical step, where the noise is drawn
(`count_step`, in `tf_dpadam.training.update`): not a callback, not the
optimizer, so that recompiling (a new optimizer starts at iteration 0),
another `fit`, `train_on_batch`, a user's `repeat` or `take` and callbacks
that stop or restore training cannot change what is counted.

Segments open in Python, before steps run: every call of the model's train
function (`PrivateModel.make_train_function`) names the mechanism of the
steps it is about to take, and a new mechanism (other noise, other
sampling, another N) closes the open segment and opens one; every `fit`
opens a segment of its own (a pass over fixed batches begins again).

The ledger goes wherever the model's state goes: `PrivateModel`
writes it into every weights store (`model.save`, `save_weights`, Keras'
`ModelCheckpoint` and `BackupAndRestore`, run folders' checkpoints) and into
`get_config` (`keras.models.clone_model`); a second `make_private` of the
same Keras model shares it. Loading never lowers it: a loaded
ledger is merged with the model's own (`Ledger.merged`: the same segment
keeps its larger count, other segments are composed), so restoring an
earlier backup keeps the steps taken since.
"""

import uuid

import numpy as np
import tensorflow as tf

from tf_dpadam.accounting import ledger as ledger_lib

# The key of the ledger in a layer's weights store.
STORE_KEY = "privacy_ledger"
# Where a wrapped model keeps the ledger of its private wrappers.
BASE_MODEL_ATTRIBUTE = "_tf_dpadam_privacy_ledger"


class ModelLedger:
    """A private model's privacy ledger: closed segments, one open, and the
    step counter the train step increments.

    Create it where the model is created (under a `tf.distribute`
    strategy's scope, the counter is mirrored and counts a logical step
    once, whatever the replicas).
    """

    def __init__(self, ledger=None):
        self._closed = ledger or ledger_lib.Ledger()
        self._open = None  # (mechanism, id, counter value at opening)
        self.counter = tf.Variable(
            0, dtype=tf.int64, trainable=False, name="privacy_ledger_steps",
            aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            synchronization=tf.VariableSynchronization.ON_WRITE)
        # Whether a weights store without a ledger was loaded (a file of a
        # version before the ledger): its history is unknown.
        self.loaded_without_ledger = False

    # ------------------------------------------------------------------
    # In the train step (traced).

    def count_step(self):
        """Counts one logical step; call it where the step's noise is
        drawn, once per logical step (in cross-replica context or, with
        replicas, in every replica: the first replica's count is kept)."""
        self.counter.assign_add(1)

    # ------------------------------------------------------------------
    # In Python, between train function calls.

    def _count(self):
        return int(self.counter.numpy())

    @property
    def mechanism(self):
        """The open segment's `Mechanism`, or None."""
        return None if self._open is None else self._open[0]

    def begin(self, mechanism, new_segment=False):
        """Makes `mechanism` the open segment's: a new segment unless the
        open one has the same mechanism and `new_segment` is False."""
        if (self._open is not None and not new_segment
                and self._open[0] == mechanism):
            return
        self._close()
        self._open = (mechanism, uuid.uuid4().hex, self._count())

    def _close(self):
        if self._open is None:
            return
        mechanism, segment_id, first = self._open
        steps = self._count() - first
        if steps:
            self._closed = self._closed.appended(
                ledger_lib.Segment(mechanism, steps, segment_id))
        self._open = None

    @property
    def ledger(self):
        """The `Ledger` of every step taken so far (a snapshot)."""
        if self._open is None:
            return self._closed
        mechanism, segment_id, first = self._open
        steps = self._count() - first
        if not steps:
            return self._closed
        return self._closed.appended(
            ledger_lib.Segment(mechanism, steps, segment_id))

    def restore(self, loaded):
        """Merges a loaded `Ledger` into this one (never lowers it)."""
        self._close()
        self._closed = self._closed.merged(loaded)

    # ------------------------------------------------------------------
    # Weights stores.

    def save_to(self, store):
        """Writes the ledger into a Keras weights store."""
        store[STORE_KEY] = np.frombuffer(
            self.ledger.dumps().encode("utf-8"), dtype=np.uint8)

    def load_from(self, store):
        """Merges the ledger of a Keras weights store, if it has one.

        Returns:
            The store's other keys, for the layer's own variables.
        """
        keys = list(store.keys())
        if STORE_KEY in keys:
            text = np.asarray(store[STORE_KEY], dtype=np.uint8).tobytes()
            self.restore(ledger_lib.Ledger.loads(text.decode("utf-8")))
        else:
            self.loaded_without_ledger = True
        return [key for key in keys if key != STORE_KEY]


def plan_source(plan):
    """What a sampling plan's batches are, for messages."""
    if hasattr(plan, "source"):
        return plan.source
    groups = getattr(plan, "groups", 1)
    return ("Poisson batches" if groups == 1
            else f"cyclic Poisson batches of {groups} groups")


class LedgerMixin:
    """The ledger's part of `PrivateModel`: the segments its train function
    opens, the stores it writes, and what users read."""

    def _init_ledger(self, base_model, config=None):
        """The model's `ModelLedger`: `get_config`'s value, or the ledger
        of an earlier private model of the same `base_model` (its weights
        carry what that one spent: wrapping them again must not start
        over), or a new one."""
        existing = getattr(base_model, BASE_MODEL_ATTRIBUTE, None)
        if existing is None:
            existing = ModelLedger()
            setattr(base_model, BASE_MODEL_ATTRIBUTE, existing)
        if config is not None:
            existing.restore(ledger_lib.Ledger.from_json(config))
        self._model_ledger = existing

    @property
    def privacy_ledger(self):
        """The `tf_dpadam.accounting.ledger.Ledger` of every DP step this
        model took (a snapshot; it survives `compile`, every `fit` and
        `train_on_batch`, save / load, `clone_model` and checkpoints)."""
        return self._model_ledger.ledger

    def add_to_privacy_ledger(self, ledger):
        """Composes `ledger` (a `Ledger`) into the model's, as loading a
        weights store does: segments it shares keep their larger count,
        the others are added. For steps the model's weights do not show
        but that were taken (a run's steps after its last checkpoint)."""
        self._model_ledger.restore(ledger)

    @property
    def loaded_without_ledger(self):
        """Whether a weights store without a privacy ledger (saved before
        tf_dpadam kept one) was loaded into this model."""
        return self._model_ledger.loaded_without_ledger

    def spent_epsilon(self, delta, accountant="pld"):
        """Epsilon at `delta` of every step in `privacy_ledger`."""
        return self.privacy_ledger.epsilon(delta, accountant)

    def ledger_mechanism(self):
        """The `Mechanism` of the steps the train function takes now: the
        running `fit`'s sampling plan, else (`train_on_batch`) any batch;
        the optimizer's sigma, or 0 if a step hook breaks the privatizer
        (the audit's deliberate breaks: epsilon is then infinite)."""
        # A loss-scale wrapper keeps the DP optimizer as `inner_optimizer`.
        optimizer = getattr(self.optimizer, "inner_optimizer", self.optimizer)
        sigma = float(optimizer.noise_multiplier)
        if any(getattr(hook, "breaks_privacy", False)
               for hook in self.step_hooks):
            sigma = 0.0
        plan = self._fit_plan
        bands = optimizer.noise_bands
        if bands > 1 and getattr(plan, "groups", 1) != bands:
            raise ValueError(
                f"Expected noise_strategy with 1 band for"
                f" {'train_on_batch' if plan is None else plan_source(plan)},"
                f" got {bands} bands: correlated noise is private with"
                f" cyclic Poisson batches of {bands} groups only. Pass"
                " in-memory x and y to fit, which samples them.")
        if plan is None:
            return ledger_lib.Mechanism.every_step(
                sigma, optimizer.dp_accumulation_steps,
                source="batches given to train_on_batch")
        return plan.mechanism(sigma)

    def begin_ledger_segment(self, new_segment=False):
        """Opens the segment of the steps about to run (see
        `ModelLedger.begin`)."""
        self._model_ledger.begin(self.ledger_mechanism(), new_segment)

    def with_ledger(self, train_function):
        """`train_function`, opening the ledger's segment before each
        call."""
        def counted(*args, **kwargs):
            self.begin_ledger_segment()
            return train_function(*args, **kwargs)

        counted.counts_privacy = True
        return counted

    def save_own_variables(self, store):
        super().save_own_variables(store)
        self._model_ledger.save_to(store)

    def load_own_variables(self, store):
        keys = self._model_ledger.load_from(store)
        super().load_own_variables({key: store[key] for key in keys})
