"""Runs the harness's binaries as `python -m research.<binary> ARGS` would,
many cases in one process: tests of their command lines.

A process per case would pay TensorFlow's import (~6 s) each time; here one
driver process imports the binaries once and forks a child per case, which
runs the binary's own `define_flags()` and `shared_flags.run(main)` with the
case's arguments. The children must fail (or stop) before any TensorFlow op:
TensorFlow is not fork-safe once it has run.
"""

import json
import os
import subprocess
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))

# Reads [{"module", "args", "mode"}] on stdin; writes [{"code", "stdout",
# "stderr"}] on stdout.
_DRIVER = r"""
import importlib, json, os, sys, tempfile, traceback
cases = json.load(sys.stdin)
from research import shared_flags
modules = {name: importlib.import_module(name)
           for name in sorted({case["module"] for case in cases})}
from absl import flags
results = []
for case in cases:
    module = modules[case["module"]]
    files = [tempfile.TemporaryFile() for _ in range(2)]
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.dup2(files[0].fileno(), 1)
        os.dup2(files[1].fileno(), 2)
        code = 0
        try:
            sys.argv = [module.__file__, *case["args"]]
            before = set(flags.FLAGS)
            module.define_flags()
            if case["mode"] == "help":
                # What --help prints for `python -m`: the main module's key
                # flags (here registered under the module's name).
                print(json.dumps({
                    "defined": sorted(set(flags.FLAGS) - before),
                    "help": flags.FLAGS.module_help(module.__name__)}))
            elif case["mode"] == "parse":
                flags.FLAGS(sys.argv)  # Flag values and validators only.
            else:
                shared_flags.run(module.main)
        except SystemExit as exit:
            code = exit.code if isinstance(exit.code, int) else 1
        except BaseException:
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    outputs = []
    for f in files:
        f.seek(0)
        outputs.append(f.read().decode(errors="replace"))
    results.append({"code": os.waitstatus_to_exitcode(status),
                    "stdout": outputs[0], "stderr": outputs[1]})
print("RESULTS " + json.dumps(results))
"""


def run_cases(cases):
    """Runs the cases (dicts: "module", e.g. "research.train_image"; "args";
    "mode": "run" as `python -m`, "parse" the flags only, or "help" the
    flags that --help lists) forked from one process; returns dicts of
    "code", "stdout" and "stderr"."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (_ROOT, os.environ.get("PYTHONPATH")) if p))
    process = subprocess.run(
        [sys.executable, "-c", _DRIVER], input=json.dumps(cases), cwd=_ROOT,
        env=env, capture_output=True, text=True, timeout=600, check=False)
    lines = [l for l in process.stdout.splitlines()
             if l.startswith("RESULTS ")]
    if process.returncode != 0 or len(lines) != 1:
        raise AssertionError(f"The driver failed:\n{process.stderr[-3000:]}")
    return json.loads(lines[0][len("RESULTS "):])
