"""`train_text --finetune`: what each mode trains, and a LoRA run resumes."""

import os
import tempfile

import keras
import numpy as np
from absl.testing import absltest


from research import datasets
from research import finetune
from research import models
from research import train_text

import helpers
from research.tests import research_helpers


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
        with self.assertRaisesRegex(ValueError, "finetune_blocks=0"):
            finetune.check_finetune("lora", 8, blocks=0)
        with self.assertRaisesRegex(ValueError, "finetune_blocks=2"):
            finetune.check_finetune("last_block", 8, blocks=2)
        with self.assertRaisesRegex(ValueError, "finetune='all'"):
            finetune.check_finetune("all", 8)
        with self.assertRaisesRegex(ValueError, "lora_rank=0"):
            finetune.check_finetune("lora", 0)

    def test_the_binary_defaults_to_full_on_the_top_two_blocks(self):
        # train_text's flags: unset --finetune_blocks is the measured 2 for
        # lora and full; 0 is every block and the embeddings; the other
        # modes keep theirs, and a 0 there is refused.
        self.assertEqual(finetune.DEFAULT_FINETUNE, "full")
        for mode in ("lora", "full"):
            self.assertEqual(finetune.resolve_blocks(mode, None), 2)
            self.assertIsNone(finetune.resolve_blocks(mode, 0))
            self.assertEqual(finetune.resolve_blocks(mode, 3), 3)
        for mode in ("last_block", "scratch"):
            self.assertIsNone(finetune.resolve_blocks(mode, None))
            with self.assertRaisesRegex(ValueError, "finetune_blocks=0"):
                finetune.check_finetune(
                    mode, 8, finetune.resolve_blocks(mode, 0))

    def test_top_blocks_of_each_mode(self):
        """`blocks=1` of 3: only the top block (and the head) trains, with
        its pretrained weights; the blocks below and the embeddings are
        the frozen part that `split_text_classifier` caches."""
        for mode in ("lora", "full"):
            with self.subTest(mode):
                backbone, preprocessor = models.make_tiny_bert(
                    num_layers=3, sequence_length=8)
                top_block = backbone.transformer_layers[-1]
                pretrained = {v.path: v.numpy() for v in top_block.weights}
                model, _ = finetune.make_classifier(
                    (backbone, preprocessor), 2, finetune=mode, lora_rank=2,
                    blocks=1)
                trainable = [v.path for v in model.trainable_variables]
                for path in trainable:
                    self.assertTrue(
                        path.startswith((top_block.name + "/", "head/")),
                        path)
                if mode == "lora":
                    self._assert_lora_trainable(model, num_blocks=1)
                else:
                    top_weights = [v.path for v in top_block.weights]
                    self.assertCountEqual(
                        trainable, top_weights + ["head/kernel", "head/bias"])
                # Not re-initialized (LoRA adds factors beside these).
                after = {v.path: v.numpy() for v in top_block.weights}
                for path, value in pretrained.items():
                    np.testing.assert_array_equal(after[path], value, path)
                frozen, top = models.split_text_classifier(model)
                self.assertEmpty(frozen.trainable_variables)
                self.assertCountEqual(
                    [v.path for v in top.trainable_variables], trainable)

    def test_mean_pooled_modes_equal_brute_force(self):
        """One noise-free DP-SGD step of LoRA / full fine-tuning with the
        mean-pooled head (the default for these modes; padded tokens left
        out of the mean) equals brute-force per-example clipping."""
        batch = helpers.BATCH
        x, y = helpers.random_bert_batch(np.random.default_rng(0), 8, batch)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        for mode, blocks in (("lora", 1), ("full", None), ("scratch", None)):
            with self.subTest(mode):
                keras.utils.set_random_seed(0)
                model, _ = finetune.make_classifier(
                    models.make_tiny_bert(num_layers=2, sequence_length=8,
                                          dropout=0.0),
                    2, finetune=mode, lora_rank=2, blocks=blocks,
                    dropout=0.0)
                self.assertIn("mean_pooling",
                              [layer.name for layer in model.layers])
                variables = model.trainable_variables
                clip, want = helpers.reference_dpsgd_step(self, model, loss,
                                                          x, y)
                before = helpers.numpy_values(variables)
                private = helpers.noise_free_dpsgd_step(model, loss, clip, x,
                                                        y)
                self.assertEqual(private.clipping_used, "ghost")
                helpers.assert_update(variables, before, want)

    def test_scratch_is_a_small_random_bert_on_the_vocabulary(self):
        pair = models.make_tiny_bert(sequence_length=8)
        pretrained = pair[0].get_layer("token_embedding").get_weights()[0]
        model, preprocessor = finetune.make_classifier(
            pair, 2, finetune="scratch", seed=1)
        self.assertIs(preprocessor, pair[1])
        self.assertLen(model.trainable_variables, len(model.weights))
        table = model.get_layer("token_embedding").get_weights()[0]
        self.assertEqual(
            table.shape, (preprocessor.tokenizer.vocabulary_size(),
                          finetune.SCRATCH_SHAPE["hidden_dim"]))
        self.assertNotEqual(table.shape, pretrained.shape)
        self.assertLen([layer for layer in model.layers
                        if "transformer_layer" in layer.name],
                       finetune.SCRATCH_SHAPE["num_layers"])
        # The seed decides the weights.
        again, _ = finetune.make_classifier(pair, 2, finetune="scratch",
                                            seed=1)
        other, _ = finetune.make_classifier(pair, 2, finetune="scratch",
                                            seed=2)
        np.testing.assert_array_equal(
            again.get_layer("token_embedding").get_weights()[0], table)
        self.assertFalse(np.array_equal(
            other.get_layer("token_embedding").get_weights()[0], table))
        with self.assertRaisesRegex(ValueError, "finetune_blocks=1"):
            finetune.check_finetune("scratch", 8, blocks=1)

    def test_mean_pooling_ignores_padding(self):
        sequence = np.arange(2 * 3 * 2, dtype="float32").reshape(2, 3, 2)
        mask = np.array([[1, 1, 0], [1, 0, 0]], "int32")
        np.testing.assert_allclose(
            models.MaskedMeanPooling()(sequence, mask),
            [sequence[0, :2].mean(0), sequence[1, 0]])
        with self.assertRaisesRegex(ValueError, "pooling='max'"):
            finetune.make_classifier(
                models.make_tiny_bert(sequence_length=8), 2, finetune="lora",
                pooling="max")

    def test_cached_lora_top_block_run_saves_the_classifier(self):
        """A LoRA run on the top block's cached inputs saves a classifier
        (token ids in) that scores what the run reported."""
        model_dir = tempfile.mkdtemp()
        data_dir = research_helpers.write_sst2_tsv()
        backbone = models.make_tiny_bert(sequence_length=16)
        results = train_text.run(
            "sst2_tsv", data_dir, None, 16,
            research_helpers.train_config(epochs=2 * 16 / 48, physical_batch_size=16,
                                 eval_every=100, model_dir=model_dir,
                                 learning_rate=0.01),
            backbone=backbone, finetune="lora", lora_rank=2,
            finetune_blocks=1, cache_frozen=True)
        self.assertEqual(results["steps"], 2)
        checkpoint = keras.models.load_model(
            os.path.join(model_dir, "checkpoint.keras"))
        # The private model trained the top (features in), not the whole
        # classifier.
        self.assertIn("sequence", checkpoint.base_model.input)
        self._assert_lora_trainable(checkpoint.base_model, num_blocks=1)
        for path, value in _lora_factors(checkpoint.base_model).items():
            self.assertGreater(np.abs(value).max(), 0.0, path)
        classifier = keras.models.load_model(
            os.path.join(model_dir, train_text.CLASSIFIER_FILE))
        (_, (x_test, y_test)), _ = datasets.load_text_dataset(
            "sst2_tsv", data_dir)
        logits = classifier.predict(
            datasets.preprocess(backbone[1], x_test), verbose=0)
        accuracy = np.mean(np.argmax(logits, -1) == y_test)
        self.assertAlmostEqual(accuracy, results["test_accuracy"], places=6)

    def test_lora_run_saves_its_factors(self):
        model_dir = tempfile.mkdtemp()
        results = train_text.run(
            "sst2_tsv", research_helpers.write_sst2_tsv(), None, 16,
            research_helpers.train_config(epochs=2 * 16 / 48, physical_batch_size=16,
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
