"""Adaptive clipping from a C far off, against the tuned C (issue 36).

    python -m research.adaptive_clipping_study

The setting of `research/results/RESULTS_fashion_mnist.md`: the paper CNN on
Fashion-MNIST, DP-AdamBC (lr 0.001, gamma' = 0.04 Phi), sigma = 0.52,
Poisson B = 256, 719 steps (epsilon = 7 at delta = 1e-5, RDP). Each
--initial_clips value starts adaptive clipping (target quantile
--target_unclipped_quantile) from that C; --fixed_clip trains with the tuned
C = 1 held fixed, in the same code. Every run's result goes to --output (a
JSON list, one entry per run, rewritten after each run); a rerun skips the
runs already there. `--report` writes the Markdown page from it.
"""

import json
import os
import time

from absl import app
from absl import flags
import keras
import numpy as np

import tf_dpadam
from research import datasets
from research import models


def define_flags():
    """The study's flags: defined by the binary only, so that importing this
    module (its test does) leaves the shared training flags' names free."""
    flags.DEFINE_list("initial_clips", ["0.01", "100"], "Adaptive runs' C_0.")
    flags.DEFINE_float("fixed_clip", 1.0, "The tuned fixed C (0: none).")
    flags.DEFINE_list("seeds", ["0", "1", "2"], "Initialization seeds.")
    flags.DEFINE_float("target_unclipped_quantile", 0.5, "gamma.")
    flags.DEFINE_float("clip_learning_rate", 0.2, "eta.")
    flags.DEFINE_integer("steps", 719, "Steps (epsilon 7 with RDP).")
    flags.DEFINE_float("learning_rate", 1e-3, "DP-AdamBC's tuned lr.")
    flags.DEFINE_string("output", "research/run_records/adaptive_clipping.json",
                        "Results (JSON).")
    flags.DEFINE_string("report", None, "Write the Markdown table here (and the"
                        " plot of C beside it, .png) and exit.")
    flags.DEFINE_string("data_dir", None, "Fashion-MNIST's folder.")


FLAGS = flags.FLAGS

SIGMA, BATCH, DELTA = 0.52, 256, 1e-5


class ClipLog(keras.callbacks.Callback):
    """C after every 50 steps."""

    def __init__(self):
        super().__init__()
        self.clips = []

    def on_train_batch_end(self, batch, logs=None):
        step = int(self.model.optimizer.iterations.numpy())
        if step % 50 == 0:
            self.clips.append((step, float(self.model.optimizer.l2_norm_clip)))


def train_one(train, test, seed, clip, adaptive):
    (x, y), (x_test, y_test) = train, test
    keras.utils.set_random_seed(seed)
    model = tf_dpadam.make_private(models.make_cnn(x.shape[1:], 10))
    model.compile(
        optimizer=tf_dpadam.DPAdamCorrected(
            l2_norm_clip=clip, noise_multiplier=SIGMA, batch_size=BATCH,
            learning_rate=FLAGS.learning_rate,
            target_unclipped_quantile=(FLAGS.target_unclipped_quantile
                                       if adaptive else None),
            clip_learning_rate=FLAGS.clip_learning_rate),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        weighted_metrics=["accuracy"])
    log = ClipLog()
    start = time.time()
    model.fit(x, y, epochs=1, steps_per_epoch=FLAGS.steps, callbacks=[log],
              verbose=2)
    _, accuracy = model.evaluate(x_test, y_test, batch_size=512, verbose=0)
    epsilon = model.spent_epsilon(DELTA, accountant="rdp")  # Its ledger.
    return dict(seed=seed, initial_clip=clip, adaptive=adaptive,
                target_unclipped_quantile=FLAGS.target_unclipped_quantile,
                clip_learning_rate=FLAGS.clip_learning_rate,
                accuracy=float(accuracy), epsilon=float(epsilon),
                steps=model.privacy_ledger.steps,
                final_clip=float(model.optimizer.l2_norm_clip),
                clips=log.clips, wall_s=round(time.time() - start, 1))


def read(path):
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return json.load(f)


def quantile_of(record):
    """gamma of an adaptive run (records written before it was kept: 0.5,
    the flag's default then)."""
    return record.get("target_unclipped_quantile", 0.5)


def quantiles(results):
    """The gammas of the adaptive runs in `results`, sorted."""
    return sorted({quantile_of(r) for r in results if r["adaptive"]})


def report(results):
    """The Markdown page: mean +- std accuracy of each setting."""
    rows = []
    settings = sorted({(r["adaptive"], r["initial_clip"]) for r in results})
    for adaptive, clip in settings:
        runs = [r for r in results
                if (r["adaptive"], r["initial_clip"]) == (adaptive, clip)]
        acc = 100 * np.array([r["accuracy"] for r in runs])
        final = [r["final_clip"] for r in runs]
        rows.append(
            f"| {'adaptive' if adaptive else 'fixed'} | {clip:g} |"
            f" {len(runs)} | {acc.mean():.2f} ± {acc.std(ddof=1) if len(acc) > 1 else 0:.2f} |"
            f" {np.mean(final):.3g} | {max(r['epsilon'] for r in runs):.3f} |")
    return "\n".join([
        "| C | C_0 | seeds | test accuracy (%) | final C (mean) | ε |",
        "|---|---|---|---|---|---|", *rows])


def plot(results, path):
    """C against the step (log scale), one line per adaptive run (PNG)."""
    import matplotlib  # pylint: disable=g-import-not-at-top
    matplotlib.use("Agg")
    from matplotlib import pyplot  # pylint: disable=g-import-not-at-top
    gammas = ", ".join(f"{g:g}" for g in quantiles(results))
    figure, axes = pyplot.subplots(figsize=(6, 3.5))
    for r in results:
        if r["adaptive"] and r["clips"]:
            steps, clips = zip(*([(0, r["initial_clip"])] + r["clips"]))
            axes.plot(steps, clips, label=f"C_0 = {r['initial_clip']:g},"
                      f" seed {r['seed']}")
    axes.axhline(1.0, color="black", linestyle=":", label="tuned fixed C")
    axes.set(yscale="log", xlabel="step", ylabel="C",
             title=f"Adaptive clipping (gamma = {gammas}), paper CNN,"
                   " Fashion-MNIST")
    axes.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv):
    del argv
    results = read(FLAGS.output)
    if FLAGS.report:
        with open(FLAGS.report, "w") as f:
            f.write(report(results) + "\n")
        plot(results, os.path.splitext(FLAGS.report)[0] + ".png")
        return
    others = [g for g in quantiles(results)
              if g != FLAGS.target_unclipped_quantile]
    if others:
        # A finished run at another gamma would be read as this one's.
        raise ValueError(
            f"--output={FLAGS.output} holds adaptive runs at"
            f" --target_unclipped_quantile={others[0]:g}, not"
            f" {FLAGS.target_unclipped_quantile:g}: give each gamma its own"
            " --output")
    train, test = datasets.load_image_dataset("fashion_mnist", FLAGS.data_dir)
    plan = [(float(c), True) for c in FLAGS.initial_clips]
    if FLAGS.fixed_clip:
        plan.append((FLAGS.fixed_clip, False))
    for seed in map(int, FLAGS.seeds):
        for clip, adaptive in plan:
            if any((r["seed"], r["initial_clip"], r["adaptive"])
                   == (seed, clip, adaptive) for r in results):
                continue
            results.append(train_one(train, test, seed, clip, adaptive))
            print(json.dumps({k: v for k, v in results[-1].items()
                              if k != "clips"}), flush=True)
            with open(FLAGS.output + ".partial", "w") as f:
                json.dump(results, f, indent=1)
            os.replace(FLAGS.output + ".partial", FLAGS.output)
    print(report(results))


if __name__ == "__main__":
    define_flags()
    app.run(main)
