"""`train_text --finetune`: what each mode trains, and a LoRA run resumes."""

import os
import tempfile

import keras
import numpy as np
from absl.testing import absltest

from examples import finetune
from examples import models
from examples import train_text

import helpers


def _lora_factors(model):
    return {v.path: v.numpy() for v in model.weights
            if "lora_kernel" in v.path}


class FinetuneModesTest(absltest.TestCase):

    def _assert_lora_trainable(self, model, num_blocks):
        """Trainable: the factors, the projections' biases and the head."""
        trainable = [v.path for v in model.trainable_variables]
        factors = [p for p in trainable if "lora_kernel" in p]
        # A and B on the 4 attention projections of each block.
        self.assertLen(factors, num_blocks * 4 * 2)
        for path in trainable:
            self.assertTrue(
                "lora_kernel" in path or path.startswith("head")
                or (path.endswith("bias") and any(
                    f"/{t}/" in path for t in finetune.LORA_TARGETS)), path)

    def test_trainable_weights_of_each_mode(self):
        for mode in ("lora", "full"):
            with self.subTest(mode):
                backbone, preprocessor = models.make_tiny_bert(
                    num_layers=2, sequence_length=8)
                embedding = backbone.get_layer("token_embedding")
                pretrained = embedding.get_weights()
                model, _ = finetune.make_classifier(
                    (backbone, preprocessor), 2, finetune=mode, lora_rank=2)
                trainable = [v.path for v in model.trainable_variables]
                if mode == "full":
                    self.assertLen(trainable, len(model.weights))
                else:
                    self._assert_lora_trainable(model, num_blocks=2)
                # Pretrained weights are kept.
                np.testing.assert_array_equal(
                    embedding.get_weights()[0],
                    pretrained[0])
        with self.assertRaisesRegex(ValueError, "finetune='all'"):
            finetune.check_finetune("all", 8)
        with self.assertRaisesRegex(ValueError, "lora_rank=0"):
            finetune.check_finetune("lora", 0)

    def test_lora_run_saves_its_factors(self):
        model_dir = tempfile.mkdtemp()
        results = train_text.run(
            "sst2_tsv", helpers.write_sst2_tsv(), None, 16,
            helpers.train_config(epochs=2 * 16 / 48, physical_batch_size=16,
                                 eval_every=100, model_dir=model_dir,
                                 learning_rate=0.01),
            backbone=models.make_tiny_bert(sequence_length=16),
            finetune="lora", lora_rank=2)
        self.assertEqual(results["steps"], 2)
        checkpoint = keras.models.load_model(
            os.path.join(model_dir, "checkpoint.keras"))
        self._assert_lora_trainable(checkpoint.base_model, num_blocks=2)
        # The checkpoint holds trained factors, not Keras' merged kernel
        # with zero factors (from which LoRA could not resume: zero
        # factors have zero gradients). B starts at zero.
        factors = _lora_factors(checkpoint.base_model)
        for path, value in factors.items():
            self.assertGreater(np.abs(value).max(), 0.0, path)


if __name__ == "__main__":
    absltest.main()
