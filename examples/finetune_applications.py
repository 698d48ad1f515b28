"""Fine-tunes a `keras.applications` model with DP: `fix`, adaptive clipping.

    python -m examples.finetune_applications --model=mobilenet_v2

A pretrained ImageNet backbone has BatchNormalization, which mixes the
examples of a batch; `tf_dpadam.validate` lists those layers and
`tf_dpadam.fix(model, batch_norm="freeze")` returns a copy that runs them in
inference mode with their pretrained statistics (the usual choice for DP
fine-tuning; "group" replaces them by GroupNormalization). C starts from a
rough guess (--l2_norm_clip) and adaptive clipping moves it to the
--target_unclipped_quantile of the per-example gradient norms. The data are
a Fashion-MNIST subset as 32x32 RGB images (the smallest input the
applications take); ImageNet weights need the internet (--weights=none
trains from scratch, offline).
"""

import glob
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # Before TensorFlow.

from absl import app  # pylint: disable=g-import-not-at-top
from absl import flags
import numpy as np

import tf_dpadam  # TensorFlow loads on first use (--help needs none).
from tf_dpadam.common import command_line

# --model: its keras.applications class, and how the name of its ImageNet
# weights in Keras' cache (~/.keras/models) begins.
APPLICATIONS = {"mobilenet_v2": ("MobileNetV2", "mobilenet_v2"),
                "resnet50": ("ResNet50", "resnet50"),
                "efficientnet_b0": ("EfficientNetB0", "efficientnetb0")}
FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"  # Debian's package.

flags.DEFINE_enum("model", "mobilenet_v2", list(APPLICATIONS), "Backbone.")
flags.DEFINE_enum("weights", "imagenet", ["imagenet", "none"],
                  "Pretrained weights (downloaded by Keras) or none.")
flags.DEFINE_enum("batch_norm", "freeze", ["freeze", "group"],
                  "How `tf_dpadam.fix` repairs BatchNormalization.")
flags.DEFINE_string("data_dir", FASHION_MNIST_DIR, "Fashion-MNIST's folder.")
flags.DEFINE_integer("max_examples", 4000, "Training examples used.",
                     lower_bound=1)
flags.DEFINE_integer("test_examples", 2000, "Test examples used.",
                     lower_bound=1)
flags.DEFINE_float("l2_norm_clip", 10.0, "Initial C (a rough guess).")
flags.DEFINE_float("target_unclipped_quantile", 0.5, "Adaptive clipping's"
                   " gamma (0 keeps C fixed).")
flags.DEFINE_float("noise_multiplier", 1.0, "sigma.")
flags.DEFINE_integer("batch_size", 128, "Expected batch size B.",
                     lower_bound=1)
flags.DEFINE_float("learning_rate", 1e-3, "DP-AdamBC's learning rate.")
flags.DEFINE_float("target_epsilon", 7.0, "The most steps with this epsilon.")
flags.DEFINE_float("delta", 1e-5, "delta of the guarantee.")
flags.DEFINE_integer("max_steps", None, "At most this many (a quick run).",
                     lower_bound=1)
FLAGS = flags.FLAGS


def load_subset(data_dir, max_examples, test_examples):
    """Fashion-MNIST as float32 32x32x3 images in [0, 1] (padded, grey
    repeated to RGB) and int32 labels: `(train, test)`."""
    import gzip  # pylint: disable=g-import-not-at-top

    def read(name):
        with gzip.open(os.path.join(data_dir, name)) as f:
            data = f.read()
        shape = np.frombuffer(data, ">u4", data[3], offset=4)
        return np.frombuffer(data, np.uint8,
                             offset=4 + 4 * data[3]).reshape(shape)

    def images(x):
        x = np.pad(x.astype("float32") / 255.0, ((0, 0), (2, 2), (2, 2)))
        return np.repeat(x[..., None], 3, axis=-1)

    splits = []
    for split, n in (("train", max_examples), ("t10k", test_examples)):
        x = read(f"{split}-images-idx3-ubyte.gz")[:n]
        y = read(f"{split}-labels-idx1-ubyte.gz")[:n]
        splits.append((images(x), y.astype("int32")))
    return splits


def make_model(name, weights, num_classes=10):
    """The backbone (ImageNet weights or none), average-pooled, and a new
    Dense head."""
    import keras  # pylint: disable=g-import-not-at-top
    backbone = getattr(keras.applications, APPLICATIONS[name][0])(
        include_top=False, weights=None if weights == "none" else weights,
        input_shape=(32, 32, 3), pooling="avg")
    inputs = keras.Input((32, 32, 3))
    # The applications expect their own input scaling of [0, 255] images.
    scaled = keras.layers.Rescaling(255.0)(inputs)
    outputs = keras.layers.Dense(num_classes)(backbone(scaled))
    return keras.Model(inputs, outputs, name=f"{name}_classifier")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    try:
        (x, y), (x_test, y_test) = load_subset(
            FLAGS.data_dir, FLAGS.max_examples, FLAGS.test_examples)
    except OSError as error:
        raise app.UsageError(f"--data_dir: {error}; it must hold Fashion-"
                             "MNIST's four *-ubyte.gz files") from error
    cached = os.path.join(os.environ.get("KERAS_HOME", os.path.expanduser(
        "~/.keras")), "models", APPLICATIONS[FLAGS.model][1] + "*.h5")
    if FLAGS.weights == "imagenet" and not glob.glob(cached) and (
            why := command_line.unreachable("https://storage.googleapis.com")):
        raise app.UsageError(f"--weights: the ImageNet weights are not in"
                             f" {cached} and cannot be downloaded ({why});"
                             " pass --weights=none (offline)")
    import keras  # pylint: disable=g-import-not-at-top
    model = make_model(FLAGS.model, FLAGS.weights)
    problems = tf_dpadam.validate(model)
    print(f"validate: {len(problems)} problems, e.g. {problems[:1]}")
    fixed = tf_dpadam.fix(model, batch_norm=FLAGS.batch_norm)
    # Warnings (e.g. EfficientNet's adapted Normalization) do not stop us.
    left = [p for p in tf_dpadam.validate(fixed) if p.severity == "error"]
    if left:
        raise app.UsageError(f"fix left: {left}")

    # --max_steps: no search; PrivacyBudget stops at --target_epsilon.
    steps = FLAGS.max_steps or tf_dpadam.calibrate_steps(
        target_epsilon=FLAGS.target_epsilon, num_examples=len(y),
        delta=FLAGS.delta, accountant="pld", batch_size=FLAGS.batch_size,
        noise_multiplier=FLAGS.noise_multiplier)
    private = tf_dpadam.make_private(fixed)
    quantile = FLAGS.target_unclipped_quantile or None
    private.compile(
        optimizer=tf_dpadam.DPAdamCorrected(
            l2_norm_clip=FLAGS.l2_norm_clip,
            noise_multiplier=FLAGS.noise_multiplier,
            batch_size=FLAGS.batch_size, learning_rate=FLAGS.learning_rate,
            target_unclipped_quantile=quantile),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"])  # Poisson padding has weight 0.
    private.fit(x, y, epochs=1, steps_per_epoch=steps,
                callbacks=[tf_dpadam.PrivacyBudget(
                    num_examples=len(y), delta=FLAGS.delta, verbose=0,
                    target_epsilon=FLAGS.target_epsilon)],
                verbose=1 if sys.stdout.isatty() else 2)
    _, accuracy = private.evaluate(x_test, y_test, batch_size=256, verbose=0)
    done = private.privacy_ledger.steps
    epsilon = private.spent_epsilon(FLAGS.delta)  # The model's ledger, PLD.
    print(f"clipping: {private.clipping_used}; C went from"
          f" {FLAGS.l2_norm_clip:g} to {private.optimizer.l2_norm_clip:.4g}")
    print(f"test accuracy {accuracy:.4f} after {done} steps; spent epsilon"
          f" {epsilon:.3f} at delta {FLAGS.delta:g}")


if __name__ == "__main__":
    command_line.run(main)
