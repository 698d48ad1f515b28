"""`fit` that samples the way the accounting assumes, and says how it did.

The epsilon of DP-SGD (and of both DP Adams) is that of Poisson sampling only
if the batches were Poisson samples. A private model's `fit` therefore:

* on in-memory data (NumPy arrays, tensors, lists, dicts / tuples of them)
  draws Poisson batches itself (`tf_dpadam.data.poisson_batches`): the
  `batch_size` is the *expected* B (default: the optimizer's), q = B / N with
  N the examples trained on (after `validation_split`), each step's rows
  padded to a capacity M and split into the optimizer's k physical batches
  (`gradient_accumulation_steps`), so that memory stays bounded by about
  M / k rows. Without XLA each physical batch is padded only to the next
  multiple of `GRAPH_PAD_MULTIPLE` rows. `fit(..., sampling="shuffled")`
  opts out: Keras' shuffled fixed batches, accounted without amplification;
* on any other data records how it was sampled: tf_dpadam's Poisson
  pipelines (also through `PoissonBatches.map_examples`, `repeat`,
  `prefetch`) are Poisson; a user's `tf.data.Dataset`,
  `keras.utils.PyDataset` or generator is not, and since nothing says which
  rows its batches hold, every step is accounted as one participation of
  every example;
* refuses a user's function (`map`, `flat_map`, ...) on Poisson batches
  (`check_no_user_function`): on whole padded batches it may count the
  padding (drop the weights of 0 that mark it) or mix examples (batch
  statistics), which no accounting bounds. `PoissonBatches.map_examples`
  runs one on each example, the weights carried through.

The record is `model.sampling_plan` (a `tf_dpadam.accounting.plans` plan);
each `fit` opens a segment of the model's privacy ledger with it
(`tf_dpadam.training.model_ledger`), which `tf_dpadam.PrivacyBudget` accounts.
`class_weight` under Poisson sampling is folded into the examples' weights
(`class_weighted`). Under Poisson sampling the optimizer must divide by the
public expected B (its `batch_size`) and accumulate the pipeline's k
batches: anything else raises a `ValueError` before the first step.
"""

import math

import keras
import numpy as np
import tensorflow as tf

from tf_dpadam.common import compat
from tf_dpadam import data as dp_data
from tf_dpadam.data import pipeline
from tf_dpadam.data import sampling as sampling_lib
from tf_dpadam.data import sharding
from tf_dpadam.accounting import plans

SAMPLINGS = ("poisson", "shuffled")

# Without XLA, each physical Poisson batch is padded to the next multiple of
# this many rows (dynamic shapes; XLA gets static padded batches).
GRAPH_PAD_MULTIPLE = 8

# Keras' default batch size.
_KERAS_BATCH_SIZE = 32


def is_in_memory(x):
    """Whether `x` is data `fit` can sample by row: arrays and tensors (or
    lists / dicts / tuples of them), not a dataset, sequence or iterator."""
    if x is None or isinstance(
            x, (tf.data.Dataset, keras.utils.PyDataset,
                tf.distribute.DistributedDataset)):
        return False
    if hasattr(x, "__next__") or callable(x):
        return False
    leaves = keras.tree.flatten(x)
    return bool(leaves) and all(
        isinstance(v, (np.ndarray, tf.Tensor, list, np.generic))
        or hasattr(v, "__array__") for v in leaves)


def expected_batch_size(optimizer, batch_size, where="fit"):
    """The public expected B of Poisson sampling: the optimizer's.

    Raises:
        ValueError: if the optimizer divides by each step's realized size
            (`batch_size=None`), or `batch_size` disagrees with it.
    """
    denominator = optimizer.batch_size
    if denominator is None:
        raise ValueError(
            f"{where} draws Poisson batches, whose size is random and"
            " data-dependent, but the optimizer's batch_size=None divides"
            " each step by that realized size (it would then show in the"
            " update's scale, while the accounting treats it as secret)."
            " Give the optimizer the public expected batch size, e.g."
            f" {type(optimizer).__name__}(..., batch_size=256), or opt out of"
            " Poisson sampling with fit(..., sampling='shuffled') (accounted"
            " without amplification)."
        )
    if batch_size is not None and int(batch_size) != denominator:
        raise ValueError(
            f"Expected {where}'s batch_size={batch_size!r} (the expected"
            " Poisson batch size B of a logical step) to equal the"
            f" optimizer's batch_size={denominator!r} (the denominator, and"
            " Phi's B). Pass the same B to both, or leave fit's batch_size"
            " out."
        )
    return denominator


def physical_batch_size(num_examples, batch_size, accumulation_steps):
    """b for k physical batches per Poisson step (None: k = 1, b = M)."""
    if accumulation_steps == 1:
        return None
    needed, _ = sampling_lib.poisson_capacity(num_examples, batch_size, 1)
    return math.ceil(needed / accumulation_steps)


def check_poisson_plan(plan, optimizer):
    """The optimizer divides by the plan's B and accumulates its k batches.

    Raises:
        ValueError: naming the fix.
    """
    expected_batch_size(optimizer, plan.expected_batch_size,
                        where="The Poisson batches")
    k = optimizer.dp_accumulation_steps
    if k != plan.accumulation_steps:
        raise ValueError(
            f"The Poisson batches split each logical step into"
            f" {plan.accumulation_steps} physical batches"
            " (`batches.accumulation_steps`), but the optimizer has"
            f" gradient_accumulation_steps={k}: its steps would not be the"
            " sampled steps the accounting counts. Set the optimizer's"
            " gradient_accumulation_steps to batches.accumulation_steps."
        )


def check_cyclic_plan(plan, bands, draws):
    """Refuses a pipeline whose batches are not cyclic Poisson batches of
    `bands` groups starting at the noise's step `draws` (mod `bands`)."""
    groups = getattr(plan, "groups", 1)
    if groups != bands:
        return  # The ledger's refusal (`ledger_mechanism`) names the data.
    if plan.group_offset != draws % bands:
        raise ValueError(
            f"Expected cyclic Poisson batches with group_offset={draws} (the"
            f" noise's steps so far, modulo {bands}) for noise_strategy of"
            f" {bands} bands, got group_offset={plan.group_offset}: an"
            " example's steps would come closer than the bands and share"
            " noise. Build them with tf_dpadam.data.poisson_batches(...,"
            f" groups={bands},"
            " group_offset=model.noise_history.draws_for(...)), or pass"
            " in-memory x and y to fit, which does.")


def check_one_worker(strategy):
    """Refuses Poisson batches that tf.distribute would re-shard.

    With several workers, `fit` shards a `tf.data.Dataset` over them (each
    worker keeps some of each step's rows), so a step is no longer the
    Poisson sample the accounting counts; one worker's several replicas
    split each batch as it is, which is fine.

    Raises:
        ValueError: under a multi-worker strategy, naming the way out.
    """
    workers, _ = sharding.workers_and_local_replicas(strategy)
    if workers > 1:
        raise ValueError(
            f"Under a strategy of {workers} workers, fit would re-shard the"
            " Poisson batches of a tf.data.Dataset (or of in-memory data)"
            " over the workers, and a step would no longer be the Poisson"
            " sample the accounting counts. Give each worker its own shard:"
            " fit(strategy.distribute_datasets_from_function("
            "tf_dpadam.data.sharding.sharded_poisson_batches(...).dataset_fn))."
        )


# tf.data transformations that run a user's function, by class name.
_USER_FUNCTIONS = {
    "_MapDataset": "map", "_ParallelMapDataset": "map",
    "_MapAndBatchDataset": "map_and_batch", "_FlatMapDataset": "flat_map",
    "_InterleaveDataset": "interleave",
    "_ParallelInterleaveDataset": "interleave", "_ScanDataset": "scan",
    "_GroupByWindowDataset": "group_by_window",
}


def _inputs(dataset):
    """What `dataset` reads, past tf.data's own `map` in `unbatch` and
    `rebatch` (`normalize_to_dense`, then a `_RestructuredDataset`)."""
    inputs = list(compat.dataset_inputs(dataset))
    if type(dataset).__name__ == "_RestructuredDataset":
        return [j for i in inputs for j in compat.dataset_inputs(i)]
    return inputs


def user_function_on_poisson(dataset):
    """The method ("map", "flat_map", ...) of a transformation upstream of
    `dataset` that runs a user's function on the elements of tf_dpadam's
    Poisson batches (or on rows or windows made of them), else None.

    The search stops at the Poisson pipelines (the package's own
    functions, `PoissonBatches.map_examples` too, are not looked into).
    """
    reads = {}  # id(dataset): whether it reads a Poisson pipeline

    def reads_poisson(node):
        if id(node) not in reads:
            reads[id(node)] = bool(sampling_lib.poisson_plan_of(node)) or any(
                map(reads_poisson, _inputs(node)))
        return reads[id(node)]

    stack, seen = [dataset], set()
    while stack:
        node = stack.pop()
        if id(node) in seen or sampling_lib.poisson_plan_of(node) is not None:
            continue
        seen.add(id(node))
        method = _USER_FUNCTIONS.get(type(node).__name__)
        if method is not None and any(map(reads_poisson, _inputs(node))):
            return method
        stack.extend(_inputs(node))
    return None


def check_no_user_function(dataset):
    """`ValueError` for a user's function on Poisson batches, naming
    `PoissonBatches.map_examples` and the other ways (see the module)."""
    method = user_function_on_poisson(dataset)
    if method is None:
        return
    raise ValueError(
        f"fit got tf_dpadam's Poisson batches through a `{method}` of your"
        " own. It runs on whole padded batches: it can drop or change the"
        " sample weights (0) that mark the padding rows absent, so that the"
        " padding counts, or mix the examples of a batch (e.g. standardize"
        " by the batch's mean and std); one example then moves a step's"
        " clipped sum by more than C, Poisson or not. Transform each example"
        " with batches.map_examples(fn) instead (fn(x, y) -> (x, y) on one"
        " example; the weights are carried through and the batches stay"
        " Poisson). Put per-example (class) weights in the data:"
        " poisson_batches((x, y, sample_weight), ...), or fit(x, y,"
        " class_weight=...) on in-memory data. Normalize with statistics"
        " fixed beforehand (in map_examples or the model), not the batch's.")


def plan_of_data(x, accumulation_steps):
    """The sampling plan of data that `fit` does not sample itself (a
    `ValueError` for a user's function on Poisson batches)."""
    plan = sampling_lib.poisson_plan_of(x)
    if plan is not None:
        return plan
    if isinstance(x, tf.data.Dataset):
        check_no_user_function(x)
    # Nothing says which rows a batch of a user's pipeline holds (a
    # `repeat`, a `take`, an un-shuffled slice, ...): every step may hold
    # every example, each of its k physical batches once.
    k = accumulation_steps
    if isinstance(x, tf.data.Dataset):
        return plans.FixedBatchesPlan("a tf.data.Dataset", None, k)
    if isinstance(x, keras.utils.PyDataset):
        return plans.FixedBatchesPlan("a keras.utils.PyDataset", None, k)
    if isinstance(x, tf.distribute.DistributedDataset):
        return plans.FixedBatchesPlan("a distributed dataset", None, k)
    return plans.FixedBatchesPlan("a generator", None, k)


def class_weighted(y, sample_weight, class_weight):
    """Per-example weights with `class_weight` folded in, as Keras does it:
    the class of a row is y itself (integer labels, or a single column) or
    the argmax of its last axis (one-hot rows); times `sample_weight` if
    given.

    Raises:
        ValueError: if `y` is not one array or a class has no weight.
    """
    if isinstance(y, (dict, list, tuple)):
        raise ValueError(
            "Expected y to be one array with class_weight (Keras supports"
            " class_weight for single-output models only); pass per-example"
            " weights as sample_weight instead.")
    labels = np.asarray(y)
    if labels.ndim > 1 and labels.shape[-1] > 1:
        labels = np.argmax(labels, axis=-1)
    labels = labels.reshape(labels.shape[0], -1)[:, 0].astype("int64")
    missing = sorted(set(labels.tolist()) - set(int(c) for c in class_weight))
    if missing:
        raise ValueError(
            f"Expected class_weight to give a weight to every class of y;"
            f" classes {missing[:10]} have none.")
    table = np.zeros(max(max(int(c) for c in class_weight),
                         int(labels.max(initial=0))) + 1, "float32")
    for c, w in class_weight.items():
        table[int(c)] = float(w)
    weights = table[labels]
    if sample_weight is not None:
        weights = weights * np.asarray(sample_weight, "float32").reshape(
            weights.shape)
    return weights


class SamplingFitMixin:
    """`fit` with Poisson batches on in-memory data; see the module."""

    sampling_plan = None
    # The plan of the `fit` in progress (None outside `fit`), for the
    # ledger's segments (`PrivateModel.ledger_mechanism`).
    _fit_plan = None

    def _fit_under_plan(self, plan, *args, **kwargs):
        """Keras' `fit` with `plan` recorded, in a ledger segment of its
        own (a new pass over fixed batches begins with every `fit`)."""
        self.sampling_plan = plan
        self._fit_plan = plan
        try:
            self.begin_ledger_segment(new_segment=True)
            return super().fit(*args, **kwargs)
        finally:
            self._fit_plan = None

    def fit(self, x=None, y=None, batch_size=None, epochs=1,
            sample_weight=None, validation_split=0.0, validation_data=None,
            shuffle=True, steps_per_epoch=None, sampling="poisson",
            class_weight=None, **kwargs):
        """Keras' `fit`, with `sampling` ("poisson" or "shuffled")."""
        if sampling not in SAMPLINGS:
            raise ValueError(
                f"Expected sampling={sampling!r} to be one of {SAMPLINGS}.")
        optimizer = getattr(self, "optimizer", None)
        if optimizer is None or not hasattr(optimizer, "dp_config"):
            return super().fit(  # Keras' (or make_private's) own error.
                x, y, batch_size=batch_size, epochs=epochs,
                sample_weight=sample_weight,
                validation_split=validation_split,
                validation_data=validation_data, shuffle=shuffle,
                steps_per_epoch=steps_per_epoch, class_weight=class_weight,
                **kwargs)
        k = optimizer.dp_accumulation_steps
        bands = optimizer.noise_bands
        # Correlated noise: the noise's own step count, after any restart
        # of its history (`noise_history.NoiseHistory.draws_for`). Step t
        # must sample group t mod b (plus a fixed offset) for the whole
        # history: this is where every fit aligns its batches with it.
        draws = self.noise_history.draws_for(
            optimizer.noise_strategy,
            [v.shape for v in self.trainable_variables] if self.built
            else None, self.distribute_strategy)
        if not is_in_memory(x):
            plan = plan_of_data(x, k)
            if bands > 1:
                check_cyclic_plan(plan, bands, draws)
            if plan.amplified:
                check_poisson_plan(plan, optimizer)
                if isinstance(x, tf.data.Dataset):
                    check_one_worker(self.distribute_strategy)
                if class_weight is not None:
                    raise ValueError(
                        "Expected class_weight=None with Poisson batches of"
                        " your own: their weights mark the padding rows."
                        " Fold the class weights into the examples' weights"
                        " (poisson_batches((x, y, weights), ...)), or pass"
                        " in-memory x and y to fit, which folds"
                        " class_weight in.")
            return self._fit_under_plan(
                plan, x, y, batch_size=batch_size, epochs=epochs,
                sample_weight=sample_weight,
                validation_split=validation_split,
                validation_data=validation_data, shuffle=shuffle,
                steps_per_epoch=steps_per_epoch, class_weight=class_weight,
                **kwargs)

        x, y, sample_weight = (pipeline.as_rows(v, numpy_leaves=True)
                               for v in (x, y, sample_weight))
        rows = pipeline.num_rows(x)
        if validation_split and validation_data is None:
            # As Keras: the last fraction of the rows, before any sampling.
            cut = int(math.floor(rows * (1.0 - validation_split)))
            validation_data = tuple(
                v for v in (pipeline.split_rows(x, cut, rows),
                            pipeline.split_rows(y, cut, rows),
                            pipeline.split_rows(sample_weight, cut, rows))
                if v is not None)
            x, y, sample_weight = (pipeline.split_rows(v, 0, cut)
                                   for v in (x, y, sample_weight))
            rows = cut
        if sampling == "shuffled":
            b = batch_size or _KERAS_BATCH_SIZE
            plan = plans.FixedBatchesPlan(
                "shuffled fixed batches" if shuffle else "fixed batches",
                math.ceil(rows / b), k, num_examples=rows,
                logical_batch_size=min(b * k, rows))
            return self._fit_under_plan(
                plan, x, y, batch_size=batch_size, epochs=epochs,
                sample_weight=sample_weight, validation_data=validation_data,
                shuffle=shuffle, steps_per_epoch=steps_per_epoch,
                class_weight=class_weight, **kwargs)

        if y is None:
            raise ValueError(
                "fit on in-memory data draws Poisson batches of (x, y) and"
                " needs y; for a model without targets pass a"
                " tf_dpadam.data.poisson_batches dataset.")
        if class_weight is not None:
            # Each example's weight; Keras' own class_weight would clash
            # with the Poisson batches' weights.
            sample_weight = class_weighted(y, sample_weight, class_weight)
        b = expected_batch_size(optimizer, batch_size)
        check_one_worker(self.distribute_strategy)
        logical_steps = None
        if steps_per_epoch is not None:
            if steps_per_epoch % k:
                raise ValueError(
                    f"Expected steps_per_epoch={steps_per_epoch!r} (physical"
                    f" batches) to be a multiple of the optimizer's"
                    f" gradient_accumulation_steps={k}.")
            logical_steps = steps_per_epoch // k
            if logical_steps % bands:
                raise ValueError(
                    f"Expected steps_per_epoch={steps_per_epoch!r} to be a"
                    f" multiple of {bands * k} (the noise_strategy's"
                    f" {bands} bands times {k} physical batches): each"
                    " pass of cyclic Poisson batches starts at group 0.")
        arrays = (x, y) if sample_weight is None else (x, y, sample_weight)
        batches = dp_data.poisson_batches(
            arrays, expected_batch_size=b,
            physical_batch_size=physical_batch_size(rows, b, k),
            steps_per_epoch=logical_steps, seed=getattr(self, "seed", None),
            pad_to_multiple_of=(None if self.jit_compile
                                else GRAPH_PAD_MULTIPLE),
            # The steps this model took, whatever its optimizer counts (a new
            # optimizer starts at 0): a new stream of public nonces.
            first_step=self.privacy_ledger.steps,
            # Correlated noise: step t samples group t mod b of the noise's
            # own count t (`noise_history`), across `fit` calls.
            groups=bands,
            group_offset=draws,
        )
        plan = sampling_lib.poisson_plan_of(batches.dataset)
        check_poisson_plan(plan, optimizer)
        dataset = batches.dataset.apply(tf.data.experimental.assert_cardinality(
            batches.steps_per_epoch * batches.accumulation_steps))
        return self._fit_under_plan(plan, dataset, epochs=epochs,
                                    validation_data=validation_data,
                                    shuffle=False, **kwargs)
