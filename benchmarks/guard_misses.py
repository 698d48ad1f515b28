"""What the models of issue 50 leak, and what the independence guard says.

    PYTHONPATH=.:tests python benchmarks/guard_misses.py

For each case of tests/guard_misses_test.py (models that mix the examples
of a batch in ways the first guard missed), prints one Markdown row: the
remove-one sensitivity of the clipped sum measured with
`check_independence=False` (what training would leak, in units of C; the
clipping path of the whole batch in brackets) and the guard's verdict with
it on (refused, and after how many steps, or the sensitivity it let
through). A sensitivity above 1 (+1e-3 for float32 rounding) breaks the
privacy guarantee.
"""

import time

from absl import app

import guard_misses_test as cases

# Row -> a function of `check_independence` giving the `Verdict`.
ROWS = {
    f"x / max|x| over the batch, 8x record in row 5, B = "
    f"{cases.B_MAX_ABS}": cases.max_abs_verdict,
    f"centering, B = {cases.B_CENTERING:,}, 10x record":
        cases.centering_verdict,
    **{f"centering, B = {cases.B_CENTERING_1000X:,}, 1000x record, data seed"
       f" {seed}": (lambda on, seed=seed: cases.centering_verdict(
           on, n=cases.B_CENTERING_1000X, factor=1000.0, seed=seed))
       for seed in (1, 2, 3)},
    "ReZero residual around centering, first step": cases.rezero_verdict,
    "ReZero residual around centering, after 32 steps":
        cases.rezero_trained_verdict,
    **{f"MixUp (p = 0.5) as augment=, seed {seed}":
       (lambda on, seed=seed: cases.mixup_verdict(seed, on))
       for seed in cases.MIXUP_SEEDS},
    f"transpose of the batch axis and back, T == B = {cases.T}":
        cases.transposed_verdict,
}


def _cell(verdict, with_guard):
    if verdict.refusal is not None:
        reason = verdict.refusal.split(" mixes ")[0][:70]
        return f"refused at step {verdict.steps_before_refusal + 1} ({reason})"
    text = f"{verdict.sensitivity:.3g} C ({verdict.clipping_used})"
    if verdict.note:
        text += f", {verdict.note}"
    return ("not refused, " + text) if with_guard else text


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
    print("| model | sensitivity without the guard | with the guard |")
    print("|---|---|---|")
    for name, verdict_of in ROWS.items():
        start = time.perf_counter()
        off = verdict_of(False)
        on = verdict_of(True)
        print(f"| {name} | {_cell(off, False)} | {_cell(on, True)} |"
              f" <!-- {time.perf_counter() - start:.0f} s -->", flush=True)


if __name__ == "__main__":
    app.run(main)
