"""Ghost clipping of Embedding against explicit clipping."""

import keras
from absl.testing import absltest
from absl.testing import parameterized

import helpers


class EmbeddingTest(helpers.GhostLockstepMixin, parameterized.TestCase):

    @parameterized.named_parameters(("graph", False), ("jit", True))
    def test_embedding_with_repeated_ids(self, jit):
        model = helpers.sequential(
            (12,), keras.layers.Embedding(5, 4, name="embedding"),
            keras.layers.GlobalAveragePooling1D(), keras.layers.Dense(3),
            dtype="int32",
        )
        ids = helpers.rng().integers(0, 5, size=(helpers.BATCH, 12)).astype("int32")
        ids[0] = 2  # one example with a single id
        self.assert_kinds(model, embedding="ghost")
        self.assert_lockstep(model, ids, helpers.normal((helpers.BATCH, 3)), jit=jit)


if __name__ == "__main__":
    absltest.main()
