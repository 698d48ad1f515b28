"""How the audit registers on a private model (`tf_dpadam.audit.hooks`)."""

import keras
from absl.testing import absltest

import tf_dpadam
from tf_dpadam.tools.audit import hooks

import helpers


class AuditHooksTest(absltest.TestCase):

    def test_one_audit_hook_per_model(self):
        model = tf_dpadam.make_private(helpers.mlp())
        first = hooks.hooks_of(model)
        self.assertIs(hooks.hooks_of(model), first)
        self.assertEqual(model.step_hooks, (first,))
        self.assertFalse(first.supports_replica_accumulation)
        self.assertIn("one replica only", first.replica_accumulation_error())

    def test_breaks_change_c_and_the_noise(self):
        model = tf_dpadam.make_private(helpers.mlp())
        audit_hooks = hooks.hooks_of(model)
        self.assertEqual(audit_hooks.clip_norm(1.0), 1.0)
        self.assertEqual(audit_hooks.noise_stddev(2.0), 2.0)
        with self.assertWarns(UserWarning):
            hooks.break_privatizer(model, "no_noise")
        self.assertEqual(audit_hooks.noise_stddev(2.0), 0.0)
        with self.assertWarns(UserWarning):
            hooks.break_privatizer(model, "no_clipping")
        self.assertGreater(audit_hooks.clip_norm(1.0), 1e29)

    def test_needs_a_private_model(self):
        with self.assertRaisesRegex(ValueError, "PrivateModel"):
            hooks.hooks_of(keras.Sequential([keras.Input((2,))]))


if __name__ == "__main__":
    absltest.main()
