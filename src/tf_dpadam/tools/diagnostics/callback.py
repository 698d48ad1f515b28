"""`MomentDiagnostics`, the Keras callback that records `MomentSnapshot`s.

WARNING: NOT DIFFERENTIALLY PRIVATE (see `tf_dpadam.tools.diagnostics`).
"""

import keras
import numpy as np
from keras import ops

from tf_dpadam.privatizer import dp_math
from tf_dpadam import optimizers as dp_optimizers
from tf_dpadam.training import private_model
from tf_dpadam.common import validation
from tf_dpadam.tools.diagnostics import moments


def _flat(arrays):
    """The arrays raveled and concatenated, as one float64 vector."""
    return np.concatenate([np.ravel(a) for a in arrays]).astype(np.float64)


class MomentDiagnostics(keras.callbacks.Callback):
    """Tracks Adam's clean moments beside the DP optimizer's (NOT private).

    Needs a model made with `make_private(model, diagnostics=True)` and
    compiled with `DPAdam` or `DPAdamCorrected`. After every DP step (every
    k-th batch with gradient accumulation) it reads the step's clean
    gradient `model.clean_gradients` and advances m^c, v^c with the
    optimizer's betas, in float64 NumPy; at each step of `steps` it stores a
    `MomentSnapshot` of the bias-corrected m^c, v^c and the optimizer's own
    m^p, v^p (`optimizer.moments(variable)`) in `snapshots`. The callback
    must see every step from the first (`iterations == 0` when training
    begins) and needs `steps_per_execution=1`; it keeps its state across
    `fit` calls.

    Attributes:
        steps: the sorted steps to snapshot.
        snapshots: dict step -> `MomentSnapshot`.
        step: the last step folded into the clean moments.
    """

    def __init__(self, steps=(10, 500)):
        """Creates the callback.

        Args:
            steps: the optimizer steps (>= 1) at which to take a snapshot.

        Raises:
            ValueError: if a step is not an int >= 1.
        """
        super().__init__()
        steps = tuple(steps)
        validation.check(
            all(validation.is_int(step) and step >= 1 for step in steps),
            "steps", steps, "to be ints >= 1",
        )
        self.steps = tuple(sorted({int(s) for s in steps}))
        self.snapshots = {}
        self.step = 0
        self._m = None
        self._v = None

    def _check_model(self):
        model = self.model
        if not (isinstance(model, private_model.PrivateModel)
                and model.diagnostics):
            raise ValueError(
                "MomentDiagnostics needs a model made with"
                " tf_dpadam.make_private(model, diagnostics=True), which"
                " stores the clean gradient of each step."
            )
        optimizer = model.optimizer
        if not (dp_optimizers.is_dp_optimizer(optimizer)
                and isinstance(optimizer, keras.optimizers.Adam)):
            raise ValueError(
                "MomentDiagnostics compares Adam moments: compile with"
                " tf_dpadam.DPAdam or DPAdamCorrected, not"
                f" {type(optimizer).__name__}."
            )
        if getattr(optimizer, "amsgrad", False):
            raise ValueError("MomentDiagnostics needs amsgrad=False.")
        if optimizer.per_example_transform(model.trainable_variables):
            raise ValueError(
                "MomentDiagnostics compares Adam's moments of the clean and"
                " the privatized gradient; "
                f"{type(optimizer).__name__} clips a transformed gradient"
                " (scale-then-privatize, DiSK), whose moments are not"
                " those. Use DPAdam or DPAdamCorrected.")
        if getattr(model, "steps_per_execution", 1) != 1:
            raise ValueError(
                "MomentDiagnostics needs steps_per_execution=1, to see the"
                " clean gradient of every step."
            )
        return optimizer

    def _iterations(self):
        return int(ops.convert_to_numpy(self.model.optimizer.iterations))

    def on_train_begin(self, logs=None):
        self._check_model()
        iterations = self._iterations()
        if iterations != self.step:
            raise ValueError(
                f"The optimizer is at step {iterations} but MomentDiagnostics"
                f" has seen {self.step} steps: the clean moments must start"
                " with the optimizer's (attach the callback before the first"
                " step and keep it for the whole run)."
            )

    def on_train_batch_end(self, batch, logs=None):
        iterations = self._iterations()
        if iterations == self.step:
            return  # A micro-batch of an accumulated step.
        if iterations != self.step + 1:
            raise RuntimeError(
                f"The optimizer went from step {self.step} to {iterations}"
                " between two batches; MomentDiagnostics must see every"
                " step."
            )
        optimizer = self.model.optimizer
        gradients = [
            ops.convert_to_numpy(g).astype(np.float64)
            for g in self.model.clean_gradients
        ]
        if self._m is None:
            self._m = [np.zeros_like(g) for g in gradients]
            self._v = [np.zeros_like(g) for g in gradients]
        for i, g in enumerate(gradients):
            self._m[i], self._v[i] = moments.adam_moments(
                self._m[i], self._v[i], g, optimizer.beta_1, optimizer.beta_2
            )
        self.step = iterations
        if iterations in self.steps:
            self.snapshots[iterations] = self.snapshot()

    def snapshot(self):
        """A `MomentSnapshot` of the current step (after the first step)."""
        if self._m is None:
            raise ValueError("No step has been taken yet.")
        optimizer = self.model.optimizer
        beta_1, beta_2, t = optimizer.beta_1, optimizer.beta_2, self.step
        private_m, private_v = [], []
        for variable in self.model.trainable_variables:
            m, v = optimizer.moments(variable)
            private_m.append(ops.convert_to_numpy(m))
            private_v.append(ops.convert_to_numpy(v))
        m_clean, v_clean = moments.bias_correct(
            _flat(self._m), _flat(self._v), beta_1, beta_2, t
        )
        m_private, v_private = moments.bias_correct(
            _flat(private_m), _flat(private_v), beta_1, beta_2, t
        )
        phi, gamma, noise_phi = _phi_gamma_and_noise_phi(optimizer)
        return moments.MomentSnapshot(
            step=t, phi=phi, gamma=gamma, noise_phi=noise_phi,
            beta_1=float(beta_1), beta_2=float(beta_2),
            m_clean=m_clean, v_clean=v_clean,
            m_private=m_private, v_private=v_private,
        )


def _phi_gamma_and_noise_phi(optimizer):
    """(Phi, gamma', (sigma C / B)^2) of the optimizer's current step."""
    noise_phi = float(ops.convert_to_numpy(optimizer.noise_phi()))
    if isinstance(optimizer, dp_optimizers.DPAdamCorrected):
        phi_tensor = optimizer.step_phi()
        phi = float(ops.convert_to_numpy(phi_tensor))
        gamma = float(ops.convert_to_numpy(optimizer.step_gamma(phi_tensor)))
    else:
        # DP-Adam subtracts nothing; show what DP-AdamBC would do.
        phi = noise_phi
        gamma = float(ops.convert_to_numpy(dp_math.default_gamma(phi)))
    return phi, gamma, noise_phi
