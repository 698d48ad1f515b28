"""DP training under tf.distribute: several replicas, or several workers.

    python -m examples.multi_worker --cpus=2 --max_steps=20

runs `MirroredStrategy` over this machine's CPU split into --cpus logical
devices (one replica each; on GPUs, over the GPUs). With $TF_CONFIG set it
runs as one worker of a `MultiWorkerMirroredStrategy` instead; start one
process per worker, e.g. on one machine:

    TF_CONFIG='{"cluster": {"worker": ["localhost:12345", "localhost:12346"]},
      "task": {"type": "worker", "index": 0}}' python -m examples.multi_worker &
    (the same with "index": 1)

Each replica clips its own examples; per logical step the clipped sums are
all-reduced once and the noise is drawn once in total, and B and Phi are
global. Each worker Poisson-samples its own shard of the N examples with the
same q = B / N (`tf_dpadam.sharding.sharded_poisson_batches`), so the union
is exactly the Poisson(q) sample the accounting assumes. Trains a small tanh
CNN on Fashion-MNIST with DP-AdamBC and prints the test accuracy and epsilon.
"""

import gzip
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # Before TensorFlow.

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
import numpy as np

import tf_dpadam  # TensorFlow loads on first use (--help needs none).
from tf_dpadam.common import command_line

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"  # Debian's package.
FASHION_MNIST_URL = ("http://fashion-mnist.s3-website.eu-central-1"
                     ".amazonaws.com")  # tensorflow-datasets' download.

flags.DEFINE_integer("cpus", 2, "Without $TF_CONFIG: logical CPU devices,"
                     " one replica each.", lower_bound=1)
flags.DEFINE_float("l2_norm_clip", 1.0, "C.")
flags.DEFINE_float("noise_multiplier", 0.52, "sigma.")
flags.DEFINE_integer("batch_size", 256, "B, the expected global batch size.",
                     lower_bound=1)
flags.DEFINE_integer("physical_batch_size", 64, "b, rows per replica and"
                     " micro-batch (gradient accumulation beyond).",
                     lower_bound=1)
flags.DEFINE_float("learning_rate", 1e-3, "eta.")
flags.DEFINE_float("target_epsilon", 7.0, "The most steps with this epsilon.")
flags.DEFINE_float("delta", 1e-5, "delta of the guarantee.")
flags.DEFINE_integer("max_examples", None, "Train on the first this many.",
                     lower_bound=1)
flags.DEFINE_integer("max_steps", None, "At most this many steps (a quick"
                     " run).", lower_bound=1)
flags.DEFINE_string("data_dir", FASHION_MNIST_DIR, "Fashion-MNIST's folder"
                    " (else tensorflow-datasets).")
FLAGS = flags.FLAGS


def make_strategy(cpus):
    """`MultiWorkerMirroredStrategy` under $TF_CONFIG, else `MirroredStrategy`
    over the GPUs or over `cpus` logical CPUs. Call it before any other
    TensorFlow op (devices and collectives are configured at start-up)."""
    import tensorflow as tf  # pylint: disable=g-import-not-at-top
    tf.get_logger().setLevel("ERROR")  # tf.distribute's INFO lines off.
    if os.environ.get("TF_CONFIG"):
        return tf.distribute.MultiWorkerMirroredStrategy()
    if tf.config.list_physical_devices("GPU"):
        return tf.distribute.MirroredStrategy()
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * cpus)
    return tf.distribute.MirroredStrategy(
        [d.name for d in tf.config.list_logical_devices("CPU")])


def fashion_mnist_files(folder):
    """The four gzipped IDX files of Fashion-MNIST in `folder`, or []; if
    [], tensorflow-datasets' download must be possible (else a usage error,
    now rather than after minutes of retries)."""
    files = [os.path.join(folder, f"{name}-ubyte.gz") for name in (
        "train-images-idx3", "train-labels-idx1", "t10k-images-idx3",
        "t10k-labels-idx1")]
    if all(map(os.path.exists, files)):
        return files
    if not command_line.tfds_prepared("fashion_mnist") and (
            why := command_line.unreachable(FASHION_MNIST_URL)):
        raise app.UsageError(
            f"--data_dir: no Fashion-MNIST there, and no download ({why});"
            " pass --data_dir=DIR of Fashion-MNIST's four *-ubyte.gz files")
    return []


def load_fashion_mnist(folder):
    """`((x, y), (x_test, y_test))`: float32 images in [0, 1], int32 labels."""
    files = fashion_mnist_files(folder)
    if files:
        arrays = []
        for path in files:
            with gzip.open(path) as f:
                data = f.read()
            shape = np.frombuffer(data, ">u4", data[3], offset=4)
            arrays.append(np.frombuffer(data, np.uint8, offset=4 + 4 * data[3])
                          .reshape(shape))
        splits = [(arrays[0][..., None], arrays[1]),
                  (arrays[2][..., None], arrays[3])]
    else:
        import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
        splits = [tfds.as_numpy(tfds.load("fashion_mnist", split=split,
                                          batch_size=-1, as_supervised=True))
                  for split in ("train", "test")]
    return tuple((x.astype("float32") / 255.0, y.astype("int32"))
                 for x, y in splits)


def make_small_cnn(input_shape, num_classes):
    """TF-Privacy's tutorial CNN (26k weights, tanh)."""
    import keras  # pylint: disable=g-import-not-at-top
    return keras.Sequential([
        keras.Input(input_shape),
        keras.layers.Conv2D(16, 8, strides=2, padding="same",
                            activation="tanh"),
        keras.layers.MaxPooling2D(2, 1),
        keras.layers.Conv2D(32, 4, strides=2, activation="tanh"),
        keras.layers.MaxPooling2D(2, 1),
        keras.layers.Flatten(),
        keras.layers.Dense(32, activation="tanh"),
        keras.layers.Dense(num_classes),
    ])


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    fashion_mnist_files(FLAGS.data_dir)  # Fails fast: before TensorFlow.
    strategy = make_strategy(FLAGS.cpus)  # First: before any other op.
    import keras  # pylint: disable=g-import-not-at-top
    workers, local = tf_dpadam.sharding.workers_and_local_replicas(strategy)
    task = json.loads(os.environ.get("TF_CONFIG", "{}")).get("task", {})
    print(f"worker {task.get('index', 0)} of {workers}, {local} local"
          f" replica(s), {strategy.num_replicas_in_sync} in all")
    (x, y), (x_test, y_test) = load_fashion_mnist(FLAGS.data_dir)
    x, y = x[:FLAGS.max_examples], y[:FLAGS.max_examples]
    try:
        steps = tf_dpadam.calibrate_steps(
            target_epsilon=FLAGS.target_epsilon, num_examples=len(y),
            batch_size=FLAGS.batch_size, delta=FLAGS.delta,
            noise_multiplier=FLAGS.noise_multiplier, accountant="pld")
        steps = min(steps, FLAGS.max_steps or steps)
        # Every worker gets the whole data and keeps its shard (i mod W).
        batches = tf_dpadam.sharding.sharded_poisson_batches(
            (x, y), expected_batch_size=FLAGS.batch_size,
            physical_batch_size=FLAGS.physical_batch_size,
            num_workers=workers, replicas_per_worker=local,
            steps_per_epoch=steps)
    except ValueError as error:  # Settings that cannot train: one line.
        raise app.UsageError(str(error)) from error
    k = batches.accumulation_steps
    with strategy.scope():  # Build and compile under the strategy.
        model = tf_dpadam.make_private(make_small_cnn(x.shape[1:], 10))
        model.compile(
            optimizer=tf_dpadam.DPAdamCorrected(
                l2_norm_clip=FLAGS.l2_norm_clip,
                noise_multiplier=FLAGS.noise_multiplier,
                batch_size=batches.expected_batch_size,  # The global B.
                gradient_accumulation_steps=k if k > 1 else None,
                learning_rate=FLAGS.learning_rate),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            weighted_metrics=["accuracy"])  # Padding rows have weight 0.
    budget = tf_dpadam.PrivacyBudget(num_examples=batches.num_examples,
                                     delta=FLAGS.delta, accountant="pld")
    model.fit(strategy.distribute_datasets_from_function(batches.dataset_fn),
              epochs=1, steps_per_epoch=batches.micro_steps_per_epoch,
              shuffle=False,  # The batches are Poisson samples already.
              callbacks=[budget], verbose=1 if sys.stdout.isatty() else 2)
    # Every replica holds the same weights: each worker evaluates a plain
    # copy on its own (Keras' evaluate does not run on several workers).
    evaluator = make_small_cnn(x.shape[1:], 10)
    evaluator.set_weights(model.base_model.get_weights())
    evaluator.compile(loss=model.loss, metrics=["accuracy"])
    _, accuracy = evaluator.evaluate(x_test, y_test, batch_size=512, verbose=0)
    done = model.privacy_ledger.steps
    print(f"test accuracy {accuracy:.4f} after {done} steps ({k} micro-batches"
          f" of {batches.physical_batch_size} per replica each); spent"
          f" epsilon {budget.epsilon:.3f} at delta {FLAGS.delta:g}")


if __name__ == "__main__":
    command_line.run(main)
