"""Banded correlated noise at equal epsilon, before any training (issue 53).

    PYTHONPATH=src:. python benchmarks/correlated_noise_error.py

For Fashion-MNIST's setting (N = 60,000, B = 256, delta = 1e-5) at
epsilon = 3 and 8 and 1, 2 and 3 epochs, and for b = 1, 2, 4, 8 and 16
bands, prints (and plots, `--plot`) what the noise of a training run would
be:

* sigma_b, calibrated (PLD) for cyclic Poisson sampling over b groups:
  `accounting.epsilon.banded_dp_sgd_event`, i.e. DP-SGD with ceil(T / b)
  steps at the group's rate b B / N (b = 1: DP-SGD's own sigma);
* the mean squared noise of the T prefix sums of the private gradients,
  per unit of (C / B)^2: sigma_b^2 times `prefix_error` of
  `BandedToeplitz.optimized(b, T)`; SGD's and momentum's weights are such
  prefix sums, so this is the noise the model sees;
* its ratio to DP-SGD's (b = 1), below 1 where the bands help;
* the largest per-step noise variance, sigma_b^2 times the largest
  squared row norm of M^-1 (DP-AdamBC's Phi_t / Phi at b = 1);
* the same two for BISR (`BandedToeplitz.bisr(b)`), the closed form.

No model is trained: the numbers are the mechanism's, exact given the
accountant. Which bands win *in accuracy* is the results page's question;
this is what the noise alone predicts (Choquette-Choo et al. 2023 report
the gain is largest at few epochs and large epsilon).
"""

import math

from absl import app
from absl import flags

from tf_dpadam.accounting import calibration
from tf_dpadam.accounting import epsilon as accounting_epsilon
from tf_dpadam.privatizer import correlated_noise

FLAGS = flags.FLAGS
flags.DEFINE_integer("num_examples", 60_000, "N.")
flags.DEFINE_integer("batch_size", 256, "B, the expected batch size.")
flags.DEFINE_list("epsilons", ["3", "8"], "Target epsilons.")
flags.DEFINE_list("epochs", ["1", "2", "3"], "Epochs.")
flags.DEFINE_list("bands", ["1", "2", "4", "8", "16"], "Band counts b.")
flags.DEFINE_float("delta", 1e-5, "delta.")
flags.DEFINE_string("plot", None, "Also write a PNG plot here.")


def noise_of(bands, steps, target_epsilon, num_examples, batch_size,
             delta):
    """`(sigma_b, mean squared prefix noise, largest step variance)` of the
    optimized strategy, then the last two of BISR's, per unit of
    (C / B)^2."""
    if bands * batch_size > num_examples:
        raise ValueError(f"Expected bands={bands} * batch_size <="
                         f" num_examples={num_examples}.")
    # DP-SGD with ceil(T / b) steps at q = b B / N (banded_dp_sgd_event).
    group_steps = accounting_epsilon.banded_dp_sgd_event(
        bands * batch_size / num_examples, 1.0, steps, bands).count
    sigma = calibration.calibrate_noise_multiplier(
        target_epsilon=target_epsilon, num_examples=num_examples,
        batch_size=bands * batch_size, steps=group_steps, delta=delta)
    out = [sigma]
    for strategy in (correlated_noise.BandedToeplitz.optimized(bands, steps),
                     correlated_noise.BandedToeplitz.bisr(bands)):
        prefix = correlated_noise.prefix_error(strategy.coefficients, steps)
        step = float(strategy.noise_variances(steps).max())
        out += [sigma**2 * prefix, sigma**2 * step]
    return tuple(out)


def table(epsilons, epochs_list, bands_list, num_examples, batch_size,
          delta):
    """Rows `(epsilon, epochs, T, b, sigma, prefix noise, ratio, step,
    BISR's ratio, BISR's step)`."""
    rows = []
    for target in epsilons:
        for epochs in epochs_list:
            steps = accounting_epsilon.steps_for_epochs(
                epochs, num_examples, batch_size)
            base = None
            for bands in bands_list:
                sigma, prefix, step, bisr, bisr_step = noise_of(
                    bands, steps, target, num_examples, batch_size, delta)
                base = base or prefix
                rows.append((target, epochs, steps, bands, sigma, prefix,
                             prefix / base, step, bisr / base, bisr_step))
    return rows


def _plot(rows, path):
    import matplotlib  # pylint: disable=import-outside-toplevel
    matplotlib.use("Agg")
    from matplotlib import pyplot  # pylint: disable=import-outside-toplevel
    figure, axes = pyplot.subplots(figsize=(6.4, 4.0))
    keys = sorted({(r[0], r[1]) for r in rows})
    for target, epochs in keys:
        mine = [r for r in rows if (r[0], r[1]) == (target, epochs)]
        axes.plot([r[3] for r in mine], [r[6] for r in mine], marker="o",
                  label=f"ε = {target:g}, {epochs:g} epoch"
                  + ("s" if epochs != 1 else ""))
    axes.axhline(1.0, color="gray", linewidth=0.8)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("bands b (cyclic Poisson over b groups)")
    axes.set_ylabel("prefix-sum noise / DP-SGD's")
    axes.set_title("Banded noise at equal ε (Fashion-MNIST, B = 256)")
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def main(argv):
    del argv
    rows = table([float(e) for e in FLAGS.epsilons],
                 [float(e) for e in FLAGS.epochs],
                 [int(b) for b in FLAGS.bands], FLAGS.num_examples,
                 FLAGS.batch_size, FLAGS.delta)
    print("| ε | epochs | T | b | σ_b | prefix noise | ÷ DP-SGD |"
          " max step variance | BISR ÷ DP-SGD | BISR max step variance |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (target, epochs, steps, bands, sigma, prefix, ratio, step, bisr,
         bisr_step) in rows:
        print(f"| {target:g} | {epochs:g} | {steps} | {bands} |"
              f" {sigma:.3f} | {prefix:.4g} | {ratio:.3f} | {step:.3g} |"
              f" {bisr:.3f} | {bisr_step:.3g} |")
    if FLAGS.plot:
        _plot(rows, FLAGS.plot)
        print(f"Plot: {FLAGS.plot}")
    assert all(math.isfinite(r[5]) for r in rows)


if __name__ == "__main__":
    app.run(main)
