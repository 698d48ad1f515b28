"""Tests of tf_dpadam.membership.queries.

References: flips and shifts written as explicit loops over pixels, with
NumPy's reflection and zeros for the border; the list `image_queries`
builds, by what each query does to a test image.
"""

import numpy as np
import pytest

from tf_dpadam.tools.membership import queries


def images(n=2, height=5, width=6, channels=2):
    return np.random.default_rng(0).normal(size=(n, height, width, channels))


def shifted_by_loops(x, dy, dx, padding):
    """Pixel (r, c) of the output is pixel (r - dy, c - dx) of x, reflected
    into the image (without repeating the edge) or zero outside it."""
    _, height, width, _ = x.shape
    out = np.zeros_like(x)

    def reflect(i, size):
        return -i if i < 0 else (2 * (size - 1) - i if i >= size else i)

    for r in range(height):
        for c in range(width):
            i, j = r - dy, c - dx
            if padding == "reflect":
                out[:, r, c] = x[:, reflect(i, height), reflect(j, width)]
            elif 0 <= i < height and 0 <= j < width:
                out[:, r, c] = x[:, i, j]
    return out


def test_flip_mirrors_each_row():
    x = images()
    flipped = queries.horizontal_flip(x)
    for c in range(x.shape[2]):
        np.testing.assert_array_equal(flipped[:, :, c],
                                      x[:, :, x.shape[2] - 1 - c])


@pytest.mark.parametrize("padding", ["reflect", "constant"])
@pytest.mark.parametrize("dy,dx", [(0, 0), (2, 0), (-2, 0), (0, 3), (1, -4),
                                   (-3, 2)])
def test_shift_against_loops(dy, dx, padding):
    x = images()
    got = queries.shift(dy, dx, padding)(x)
    assert got.shape == x.shape
    np.testing.assert_array_equal(got, shifted_by_loops(x, dy, dx, padding))


def test_image_queries():
    x = images(n=1)
    assert len(queries.image_queries(flip=False)) == 1
    assert len(queries.image_queries(flip=True)) == 2
    five = queries.image_queries(flip=False, max_shift=1)
    ten = queries.image_queries(flip=True, max_shift=1)
    assert len(five) == 5 and len(ten) == 10
    np.testing.assert_array_equal(ten[0](x), x)  # The identity first.
    want = [x] + [shifted_by_loops(x, dy, dx, "reflect")
                  for dy, dx in ((-1, 0), (1, 0), (0, -1), (0, 1))]
    for got, view in zip(ten[:5], want):
        np.testing.assert_array_equal(got(x), view)
    for got, view in zip(ten[5:], want):
        np.testing.assert_array_equal(got(x), view[:, :, ::-1])
    # No two views are the same on a generic image.
    views = [q(x).ravel() for q in ten]
    assert len({v.tobytes() for v in views}) == 10


def test_bad_arguments_name_themselves():
    with pytest.raises(ValueError, match="max_shift"):
        queries.image_queries(max_shift=-1)
    with pytest.raises(ValueError, match="flip"):
        queries.image_queries(flip="yes")
    with pytest.raises(ValueError, match="padding"):
        queries.shift(1, 0, padding="wrap")
    with pytest.raises(ValueError, match="shift"):
        queries.shift(1.5, 0)
    with pytest.raises(ValueError, match="shift"):
        queries.shift(5, 0)(images(height=5))
    with pytest.raises(ValueError, match="queries"):
        queries.check_queries([])
