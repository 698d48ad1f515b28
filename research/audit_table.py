"""The README's audit table: sigma against the audit's L and the claimed E.

    python -m research.audit_table --canaries=gradient,input

Runs `research.audit` once per sigma in --sigmas with the real privatizer,
then once per break in --breaks at --break_sigma, for each canary kind, and
prints a Markdown table (also written to --output if given). Every other
setting is `research.audit`'s default (see `research.audit.AuditConfig`),
overridable with --optimizer and --steps.
"""

import dataclasses

from absl import app
from absl import flags

from research import audit  # pylint: disable=g-bad-import-order
from research import shared_flags


def define_flags():
    flags.DEFINE_list("sigmas", ["0.5", "1", "2", "4"],
                      "Noise multipliers audited with the real privatizer.")
    flags.DEFINE_list("breaks", ["no_noise", "no_clipping"],
                      "Breaks audited at --break_sigma.")
    flags.DEFINE_float("break_sigma", 2.0, "sigma of the broken runs.")
    flags.DEFINE_list("canaries", ["gradient", "input"], "Canary kinds.")
    flags.DEFINE_string("optimizer", None,
                        "Override of the audit's optimizer.")
    flags.DEFINE_integer("steps", None, "Override of the audit's steps.")
    flags.DEFINE_string("data_dir", None, "Folder of the Fashion-MNIST files.")
    flags.DEFINE_string("output", None, "Also write the table here.")


FLAGS = flags.FLAGS


def table_rows(sigmas, breaks, break_sigma, kinds, base, data_dir=None,
               run_fn=audit.run):
    """One row per (sigma, break): (result, claimed E) per canary kind.

    The claimed E differs between kinds: input canaries are training
    examples, so they lower the sampling rate q = B / (N + included).
    """
    settings = [(float(s), "none") for s in sigmas]
    settings += [(break_sigma, b) for b in breaks]
    rows = []
    for sigma, broken in settings:
        row = {"sigma": sigma, "break": broken}
        for kind in kinds:
            config = dataclasses.replace(base, noise_multiplier=sigma,
                                         broken=broken, canaries=kind)
            out = run_fn(config, data_dir, verbose=0)
            result = out["result"]
            row[kind] = (result, out["claimed_epsilon"])
            if "movement" in out.get("by_score", {}):
                row["movement"] = out["by_score"]["movement"]
            print(f"sigma {sigma:g} break {broken} {kind}:"
                  f" {result.describe(out['claimed_epsilon'])}", flush=True)
        rows.append(row)
    return rows


def _cell(result, claimed):
    flag = " **> E**" if result.epsilon_lower_bound > claimed else ""
    return (f"{result.epsilon_lower_bound:.2f}"
            f" ({result.num_correct}/{result.num_guesses}){flag}")


def markdown(rows, kinds):
    """The rows as a Markdown table."""
    header = ["sigma", "privatizer"]
    for kind in kinds:
        header += [f"{kind} canaries: L (correct/guesses)", "claimed E"]
    if "gradient" in kinds and any("movement" in row for row in rows):
        header.append("gradient canaries scored by weight movement: L")
    lines = ["| " + " | ".join(header) + " |",
             "|" + "---|" * len(header)]
    for row in rows:
        cells = [f"{row['sigma']:g}",
                 "real" if row["break"] == "none"
                 else f"**broken: {row['break']}**"]
        for kind in kinds:
            result, claimed = row[kind]
            cells += [_cell(result, claimed), f"{claimed:.2f}"]
        if "movement" in row:
            cells.append(_cell(row["movement"], row["gradient"][1]))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    base = audit.AuditConfig()
    if FLAGS.optimizer:
        base = dataclasses.replace(base, optimizer=FLAGS.optimizer)
    if FLAGS.steps:
        base = dataclasses.replace(base, steps=FLAGS.steps)
    rows = table_rows(FLAGS.sigmas, FLAGS.breaks, FLAGS.break_sigma,
                      FLAGS.canaries, base, FLAGS.data_dir)
    text = markdown(rows, FLAGS.canaries)
    print(text)
    if FLAGS.output:
        with open(FLAGS.output, "w", encoding="utf-8") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    define_flags()
    shared_flags.run(main)
