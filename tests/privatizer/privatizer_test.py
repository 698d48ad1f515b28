"""`tf_dpadam.privatizer` keeps the old import paths of the step's functions."""

from absl.testing import absltest

from tf_dpadam import privatizer
from tf_dpadam.privatizer import clipping
from tf_dpadam.privatizer import noise
from tf_dpadam.privatizer import replicas
from tf_dpadam.common import seeds


class PrivatizerTest(absltest.TestCase):

    def test_old_names_are_the_step_modules_objects(self):
        modules = (clipping, noise, replicas, seeds)
        for name in privatizer.__all__:
            owners = [m for m in modules if hasattr(m, name)]
            self.assertLen(owners, 1, name)
            self.assertIs(getattr(privatizer, name),
                          getattr(owners[0], name))


if __name__ == "__main__":
    absltest.main()
