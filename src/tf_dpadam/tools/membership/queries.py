"""Augmented queries: each example scored under several views (Carlini et al.).

A model trained with data augmentation has seen each training image flipped
and shifted, so its confidence on those views carries membership signal too.
LiRA then scores every example under each view (a query), fits one Gaussian
per example and query across the shadows, and averages the queries' tests
(`lira.lira_online`, `lira.lira_offline` with `(n, Q)` scores). A query is
a function from a batch of inputs to a batch of the same shape, applied to
the whole pool before `predict`; `model_scores(..., queries=...)` and
`train_shadows(..., queries=...)` take a list of them.

`image_queries` builds the usual ones for `(n, height, width, channels)`
images: the identity, a horizontal flip and shifts by a few pixels (the
vacated border filled by reflection, as the usual random-crop augmentation
pads). Query with the views the model trained on: a view it never saw adds
little signal and some noise.
"""

import numpy as np

from tf_dpadam.common import validation

PADDINGS = ("reflect", "constant")


def identity(x):
    """The example itself."""
    return x


def horizontal_flip(x):
    """`(n, h, w, c)` images mirrored left to right."""
    return np.asarray(x)[:, :, ::-1]


def shift(dy, dx, padding="reflect"):
    """A query that moves `(n, h, w, c)` images by (dy, dx) pixels (down,
    right), the vacated border filled by `padding` ("reflect" or
    "constant": zeros)."""
    validation.check(validation.is_int(dy) and validation.is_int(dx),
                     "shift", (dy, dx), "to be two ints")
    validation.check(padding in PADDINGS, "padding", padding,
                     f"to be one of {PADDINGS}")

    def moved(x):
        x = np.asarray(x)
        _, height, width = x.shape[:3]
        validation.check(abs(dy) < height and abs(dx) < width, "shift",
                         (dy, dx), f"to be smaller than the images ({height}"
                         f" x {width})")
        pad = [(0, 0), (abs(dy), abs(dy)), (abs(dx), abs(dx))]
        pad += [(0, 0)] * (x.ndim - 3)
        padded = np.pad(x, pad, mode=padding)
        top, left = abs(dy) - dy, abs(dx) - dx
        return padded[:, top:top + height, left:left + width]

    return moved


def image_queries(flip=True, max_shift=0, padding="reflect"):
    """The identity, a horizontal flip and shifts, as a list of queries.

    Args:
        flip: whether each view is also queried mirrored.
        max_shift: s >= 0; with s > 0, the views are shifted by s pixels up,
            down, left and right besides the unshifted one (5 positions).
        padding: how a shift fills the border ("reflect" or "constant").

    Returns:
        A list of queries, the identity first: 1, 2, 5 or 10 of them.
    """
    validation.check(isinstance(flip, bool), "flip", flip, "to be a bool")
    validation.check(validation.is_int(max_shift) and max_shift >= 0,
                     "max_shift", max_shift, "to be an int >= 0")
    offsets = [(0, 0)]
    if max_shift:
        s = max_shift
        offsets += [(-s, 0), (s, 0), (0, -s), (0, s)]
    queries = [identity] + [shift(dy, dx, padding) for dy, dx in offsets[1:]]
    if flip:
        queries += [_flipped(q) for q in queries]
    return queries


def _flipped(query):
    return lambda x: horizontal_flip(query(x))


def check_queries(queries):
    """`queries` as a list of callables (a clear `ValueError` otherwise)."""
    queries = list(queries)
    validation.check(len(queries) >= 1 and all(map(callable, queries)),
                     "queries", queries, "to be a non-empty list of"
                     " functions of a batch of inputs")
    return queries
