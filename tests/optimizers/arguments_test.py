"""The DP keyword arguments, declared once (`tf_dpadam.optimizers.arguments`).

Their names, defaults and order as the constructors took them before the
declaration (a hard list, so that a change shows), the Python-style error
for a missing one, the signature built from it, and the docstring section
generated from it.
"""

import inspect
import math

import numpy as np

import keras  # pylint: disable=unused-import  # Before tf_dpadam, as usual.
from absl.testing import absltest
from absl.testing import parameterized

import tf_dpadam
from tf_dpadam.optimizers import arguments
from tf_dpadam.privatizer import adaptive_clipping

REQUIRED = inspect.Parameter.empty
# Name -> default, as the five constructors declared them one by one.
DECLARED = {
    "l2_norm_clip": REQUIRED,
    "noise_multiplier": REQUIRED,
    "batch_size": None,
    "gradient_accumulation_steps": None,  # Was taken from **kwargs.
    "target_unclipped_quantile": None,
    "clip_learning_rate": 0.2,
    "clipped_count_stddev": None,
    "per_layer_clipping": False,
    "noise_strategy": None,
}


class ArgumentsTest(absltest.TestCase):

    def test_the_declaration(self):
        self.assertEqual({a.name: a.default for a in arguments.ARGUMENTS},
                         DECLARED)
        self.assertEqual(arguments.NAMES, tuple(DECLARED))
        for argument in arguments.ARGUMENTS:
            self.assertTrue(argument.doc.strip(), argument.name)
            self.assertIsNot(argument.annotation, REQUIRED, argument.name)
        self.assertEqual(arguments.DEFAULT_CLIP_LEARNING_RATE,
                         adaptive_clipping.DEFAULT_CLIP_LEARNING_RATE)

    def test_pop_arguments_takes_them_and_leaves_the_rest(self):
        kwargs = dict(l2_norm_clip=1.5, noise_multiplier=0.5, beta_1=0.8,
                      per_layer_clipping=True)
        dp = arguments.pop_arguments(kwargs, "DPAdam")
        self.assertEqual(kwargs, {"beta_1": 0.8})
        self.assertEqual(dp, {**DECLARED, "l2_norm_clip": 1.5,
                              "noise_multiplier": 0.5,
                              "per_layer_clipping": True})

    def test_a_missing_argument_is_pythons_type_error(self):
        with self.assertRaisesWithLiteralMatch(
                TypeError, "DPSGD.__init__() missing 1 required keyword-only"
                " argument: 'l2_norm_clip'"):
            arguments.pop_arguments({"noise_multiplier": 1.0}, "DPSGD")
        with self.assertRaisesWithLiteralMatch(
                TypeError, "DPAdam.__init__() missing 2 required keyword-only"
                " arguments: 'l2_norm_clip' and 'noise_multiplier'"):
            arguments.pop_arguments({}, "DPAdam")

    def test_the_same_messages_as_before(self):
        # What Python said when the constructors declared the arguments.
        with self.assertRaisesWithLiteralMatch(
                TypeError, "DPAdamCorrected.__init__() missing 1 required"
                " keyword-only argument: 'l2_norm_clip'"):
            tf_dpadam.DPAdamCorrected(noise_multiplier=1.0)
        with self.assertRaisesWithLiteralMatch(
                TypeError, "DPAdamDiSK.__init__() missing 2 required"
                " keyword-only arguments: 'l2_norm_clip' and"
                " 'noise_multiplier'"):
            tf_dpadam.DPAdamDiSK()
        with self.assertRaisesWithLiteralMatch(
                TypeError, "DPSGD.__init__() takes 1 positional argument but"
                " 2 were given"):
            tf_dpadam.DPSGD(1.0)  # pylint: disable=too-many-function-args
        with self.assertRaisesWithLiteralMatch(
                ValueError, "Expected l2_norm_clip=-1.0 to be a finite number"
                " > 0."):
            tf_dpadam.DPAdam(l2_norm_clip=-1.0, noise_multiplier=1.0)

    def test_signature(self):
        def init(self, *, learning_rate: float = 0.1, l2_norm_clip=3.0,
                 name="x", **kwargs):
            del self, learning_rate, l2_norm_clip, name, kwargs

        signature = arguments.signature(init)
        self.assertEqual(list(signature.parameters),
                         ["self", *DECLARED, "learning_rate", "name",
                          "kwargs"])
        parameters = signature.parameters
        self.assertEqual({n: parameters[n].default for n in DECLARED},
                         DECLARED)
        self.assertEqual(parameters["learning_rate"].default, 0.1)
        self.assertEqual(parameters["learning_rate"].annotation, float)
        for name in (*DECLARED, "learning_rate", "name"):
            self.assertEqual(parameters[name].kind,
                             inspect.Parameter.KEYWORD_ONLY, name)
        self.assertEqual(parameters["kwargs"].kind,
                         inspect.Parameter.VAR_KEYWORD)

    def test_a_positional_parameter_becomes_keyword_only(self):
        def keras_init(self, learning_rate=0.001, rho=0.9, name="rmsprop",
                       **kwargs):
            del self, learning_rate, rho, name, kwargs

        parameters = arguments.signature(keras_init).parameters
        self.assertEqual(parameters["rho"].kind,
                         inspect.Parameter.KEYWORD_ONLY)
        self.assertEqual(parameters["rho"].default, 0.9)

    def test_the_docstring_section(self):
        doc = arguments.DP_ARGS_DOC
        self.assertTrue(doc.startswith("\n    Args:\n"))
        positions = [doc.index(f"\n        {name}: ") for name in DECLARED]
        self.assertEqual(positions, sorted(positions))
        for line in doc.splitlines():
            self.assertLess(len(line), 80, line)
            self.assertTrue(line == "" or line.startswith(("    Args:",
                                                           " " * 8)), line)
        # A literal stays on one line.
        self.assertIn("`{layer name or path: C_l}`", doc)
        for cls in (tf_dpadam.DPSGD, tf_dpadam.DPAdam,
                    tf_dpadam.DPAdamCorrected,
                    tf_dpadam.DPAdamScaleThenPrivatize,
                    tf_dpadam.DPAdamDiSK):
            self.assertIn(doc, cls.__doc__, cls.__name__)



class DPConfigTest(parameterized.TestCase):

    def test_normalizes_types_and_denominator(self):
        config = arguments.DPConfig(l2_norm_clip=1, noise_multiplier=2,
                                    batch_size=np.int64(16),
                                    accumulation_steps=np.int32(4))
        self.assertEqual(
            (config.l2_norm_clip, config.noise_multiplier, config.batch_size,
             config.accumulation_steps), (1.0, 2.0, 16, 4))
        self.assertIs(type(config.batch_size), int)
        self.assertIs(type(config.l2_norm_clip), float)
        self.assertEqual(config.noise_stddev, 2.0)
        self.assertAlmostEqual(arguments.noise_stddev(0.4, 1.5), 0.6)
        self.assertEqual(config.denominator(10), 16)
        counted = arguments.DPConfig(l2_norm_clip=1.0, noise_multiplier=0.0)
        self.assertEqual(counted.denominator(10), 10)
        self.assertEqual(counted.accumulation_steps, 1)

    @parameterized.named_parameters(
        ("clip_zero", dict(l2_norm_clip=0.0),
         "Expected l2_norm_clip=0.0 to be a finite number > 0."),
        ("clip_inf", dict(l2_norm_clip=math.inf),
         "Expected l2_norm_clip=inf to be a finite number > 0."),
        ("clip_bool", dict(l2_norm_clip=True),
         "Expected l2_norm_clip=True to be a finite number > 0."),
        ("sigma_negative", dict(noise_multiplier=-0.5),
         "Expected noise_multiplier=-0.5 to be a finite number >= 0."),
        ("sigma_nan", dict(noise_multiplier=math.nan),
         "Expected noise_multiplier=nan to be a finite number >= 0."),
        ("batch_zero", dict(batch_size=0),
         "Expected batch_size=0 to be None or an int > 0."),
        ("batch_float", dict(batch_size=8.0),
         "Expected batch_size=8.0 to be None or an int > 0."),
        ("accumulation_zero", dict(accumulation_steps=0),
         "Expected gradient_accumulation_steps=0 to be None or an int >= 1."),
        ("accumulation_bool", dict(accumulation_steps=True),
         "Expected gradient_accumulation_steps=True to be None or an int"
         " >= 1."),
    )
    def test_validation_messages(self, overrides, message):
        kwargs = dict(l2_norm_clip=1.0, noise_multiplier=1.0)
        kwargs.update(overrides)
        with self.assertRaises(ValueError) as raised:
            arguments.DPConfig(**kwargs)
        self.assertEqual(str(raised.exception), message)


if __name__ == "__main__":
    absltest.main()
