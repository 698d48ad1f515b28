"""`python -m tf_dpadam.privacy`: the accounting command line's older name.

The command line lives in `tf_dpadam/privacy_cli.py`, a name that says what
it is (next to `privatizer.py` and `private_model.py`, "privacy" read like
part of the training code). This shim keeps the documented command
`python -m tf_dpadam.privacy --num_examples=... --delta=...` and imports of
`tf_dpadam.privacy` working; it adds nothing of its own.
"""

from absl import flags

from tf_dpadam import privacy_cli
from tf_dpadam.privacy_cli import define_flags
from tf_dpadam.privacy_cli import main
from tf_dpadam.privacy_cli import noise_multiplier_report
from tf_dpadam.privacy_cli import report
from tf_dpadam.privacy_cli import steps_report

__all__ = [
    "define_flags", "main", "noise_multiplier_report", "report",
    "steps_report",
]

if __name__ == "__main__":
    # --help prints the main module's docstring and key flags: those of the
    # command line.
    __doc__ = privacy_cli.__doc__
    define_flags()
    flags.adopt_module_key_flags(privacy_cli)
    privacy_cli.run(main)
