"""Breaks the rules of package_structure_test on purpose (never imported)."""
from keras.src.utils import x


def f(model):
    return model._flatten_layers()


class Optimizer(object):
    def _backend_update_step(self, grads):
        return super()._backend_update_step(grads)
