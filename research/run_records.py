"""Keeps the records of finished runs in git, to resume studies anywhere.

    python -m research.run_records save      # runs/ -> research/run_records/
    python -m research.run_records restore   # research/run_records/ -> runs/

A run folder under `runs/` (git ignores it: checkpoints are large) is
finished when its `reproduce.json` says "done"; `runs.load_record` then
needs only that file and `metrics.json`. `save` copies those two files of
every finished run into `research/run_records/` (same relative paths),
`restore` copies them back into run folders that do not hold a finished run
yet, so a study resumed on a fresh clone or another machine reads its
finished runs back instead of retraining them. Unfinished runs are not kept
(without their checkpoint they restart anyway).
"""

import os
import shutil
import sys

from research import runs

FILES = (runs.METRICS, runs.SIDECAR)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def finished(folder):
    """Whether `folder` holds a finished run (its sidecar says "done")."""
    sidecar = runs.read_json(os.path.join(folder, runs.SIDECAR))
    return (sidecar is not None and sidecar.get("status") == "done"
            and os.path.exists(os.path.join(folder, runs.METRICS)))


def finished_runs(root):
    """Relative paths of the finished run folders under `root`."""
    found = []
    for folder, _, _ in os.walk(root):
        if finished(folder):
            found.append(os.path.relpath(folder, root))
    return sorted(found)


def copy_runs(source, target, overwrite):
    """Copies the record files of `source`'s finished runs into `target`;
    with `overwrite=False` a target folder that holds a finished run is
    left alone. Returns the relative paths copied."""
    copied = []
    for name in finished_runs(source):
        destination = os.path.join(target, name)
        if not overwrite and finished(destination):
            continue
        os.makedirs(destination, exist_ok=True)
        for file in FILES:
            shutil.copy2(os.path.join(source, name, file), destination)
        copied.append(name)
    return copied


def main(argv):
    if len(argv) != 2 or argv[1] not in ("save", "restore"):
        print(__doc__.split("\n\n")[0], file=sys.stderr)
        return 2
    runs_dir = os.path.join(ROOT, "runs")
    records_dir = os.path.join(ROOT, "research", "run_records")
    if argv[1] == "save":
        copied = copy_runs(runs_dir, records_dir, overwrite=True)
    else:
        copied = copy_runs(records_dir, runs_dir, overwrite=False)
    print(f"{argv[1]}: {len(copied)} finished runs copied")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
