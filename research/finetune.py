"""Which weights of a pretrained BERT a text classifier trains.

Three modes (`train_text --finetune`):

* "last_block": the paper's setting (`models.make_text_classifier`): the
  embeddings and lower blocks frozen, the last block re-initialized and
  trained with a new head; the frozen part's features can be cached.
* "lora": the pretrained backbone frozen, rank-r LoRA factors on every
  attention projection (`LORA_TARGETS`) of every block trained with the
  head (Hu et al. 2021; Yu et al. 2022 for DP). Ghost clipping computes the
  factors' per-example norms from x, xA and the output gradient; the frozen
  kernels cost nothing extra.
* "full": every weight of the pretrained backbone and the head trained
  (Li et al. 2022), with ghost clipping choosing per layer between the
  ghost norm and materializing the per-example gradient.
* "scratch": no pretrained weight: a small BERT (`SCRATCH_SHAPE`: 2 blocks,
  128 wide) randomly initialized on the preset's tokenizer and trained
  whole with the head, the setting where Adam matters most (issue 18's
  text point).

LoRA and full fine-tuning keep the pretrained weights (nothing is
re-initialized) and put a new head on the mean of the final token states
over the unpadded tokens (`pooling="mean"`, the pooling all-MiniLM-L6-v2 was
trained with; a non-private linear probe of its frozen features on 4,000
SST-2 sentences scores 79.6% on the dev set with it, 73.6% on [CLS]);
last-block keeps the paper's [CLS] head. Both can be limited to the top `blocks` transformer blocks: the
embeddings and the blocks below are then frozen, as in last-block's model
(`models.make_text_classifier`), and `train_text` can run them once over
the data and train on their cached outputs.
"""

import keras

from research import models

FINETUNE_MODES = ("last_block", "lora", "full", "scratch")
# What `train_text` trains unless told: the best of the three modes on SST-2
# at epsilon = 7 (research/results/FINETUNE_sst2.md, 3 seeds each): full
# fine-tuning of MiniLM's top 2 blocks, DP-AdamBC 82.30 +- 0.54, against LoRA
# on the same blocks 81.84 +- 1.06 and the last block re-initialized
# 81.04 +- 0.52.
DEFAULT_FINETUNE = "full"
# The top blocks that lora and full train unless told (as measured); 0
# asks for every block and the embeddings.
DEFAULT_BLOCKS = {"lora": 2, "full": 2}
# "scratch": a small BERT, randomly initialized, on the preset's vocabulary.
SCRATCH_SHAPE = dict(num_layers=2, hidden_dim=128, num_heads=2,
                     intermediate_dim=512)
# The attention projections of a keras-hub BERT block.
LORA_TARGETS = ("query", "key", "value", "attention_output")


def check_finetune(finetune, lora_rank, blocks=None):
    """Raises a ValueError naming the bad argument."""
    if finetune not in FINETUNE_MODES:
        raise ValueError(
            f"Expected finetune={finetune!r} to be one of {FINETUNE_MODES}.")
    if not isinstance(lora_rank, int) or lora_rank < 1:
        raise ValueError(
            f"Expected lora_rank={lora_rank!r} to be a positive integer.")
    if blocks is not None:
        if not isinstance(blocks, int) or blocks < 1:
            raise ValueError(
                f"Expected finetune_blocks={blocks!r} to be a positive"
                " integer or None (every block).")
        if finetune == "last_block" and blocks != 1:
            raise ValueError(
                f"finetune_blocks={blocks} is for finetune='lora' or"
                " 'full'; 'last_block' trains one re-initialized block.")
        if finetune == "scratch":
            raise ValueError(
                f"finetune_blocks={blocks} is for finetune='lora' or"
                " 'full'; 'scratch' trains every weight.")


def resolve_blocks(finetune, blocks):
    """The `blocks` of `make_classifier` for the flag `--finetune_blocks`.

    None (unset): `DEFAULT_BLOCKS` for lora and full, None for the other
    modes; 0: None for lora and full (every block and the embeddings);
    otherwise `blocks`, checked by `check_finetune`.
    """
    if blocks is None:
        return DEFAULT_BLOCKS.get(finetune)
    if blocks == 0 and finetune in DEFAULT_BLOCKS:
        return None
    return blocks


def cacheable(finetune, blocks):
    """Whether the model has a frozen lower part whose outputs can be
    cached (`models.split_text_classifier`)."""
    return finetune == "last_block" or blocks is not None


def default_pooling(finetune):
    """What feeds the head of a mode unless told (`models.POOLINGS`)."""
    return "cls" if finetune == "last_block" else "mean"


def make_classifier(preset, num_classes, finetune="last_block",
                    sequence_length=128, lora_rank=8, seed=0, dropout=0.1,
                    blocks=None, pooling=None):
    """`(model, preprocessor)`: a BERT classifier that trains `finetune`.

    Args:
        preset, num_classes, sequence_length, seed, dropout: as for
            `models.make_text_classifier` (`preset` may be a built
            `(backbone, preprocessor)` pair).
        finetune: "last_block", "lora", "full" or "scratch" (module
            docstring).
        lora_rank: the rank of the LoRA factors ("lora" only).
        blocks: "lora" and "full": how many top transformer blocks train
            (None: the whole backbone; else the embeddings and the blocks
            below are frozen, and the model is laid out as
            `models.make_text_classifier`'s, whose frozen part
            `models.split_text_classifier` can cache).
        pooling: "cls" or "mean" (`models.pool`); None: the mode's
            `default_pooling`.

    Returns:
        The model maps the preprocessor's token dict to logits. For "lora"
        and "full" it is a functional model on the backbone's own layers
        (not a nested backbone), so a private model saves and reloads it
        with its LoRA factors and frozen flags (`tf_dpadam.training.lora_state`).
    """
    check_finetune(finetune, lora_rank, blocks)
    pooling = pooling or default_pooling(finetune)
    if pooling not in models.POOLINGS:
        raise ValueError(
            f"Expected pooling={pooling!r} to be one of {models.POOLINGS}.")
    if finetune == "last_block":
        return models.make_text_classifier(
            preset, num_classes, sequence_length=sequence_length, seed=seed,
            dropout=dropout, pooling=pooling)
    if blocks is not None:
        return _make_top_blocks_classifier(
            preset, num_classes, finetune, sequence_length, lora_rank, seed,
            dropout, blocks, pooling)
    if isinstance(preset, (tuple, list)):
        backbone, preprocessor = preset
    else:
        backbone, preprocessor = models.load_bert(preset, sequence_length)
    if finetune == "scratch":
        backbone = _scratch_backbone(preprocessor, seed, dropout)
    if finetune == "lora":
        # The factors' initializers draw from Python's `random`: seed it.
        # pylint: disable-next=protected-access
        with models._python_random_seed(seed):
            backbone.enable_lora(lora_rank,
                                 target_layer_names=list(LORA_TARGETS))
    else:
        backbone.trainable = True
    logits = models.classification_head(
        backbone.output["sequence_output"], backbone.input["padding_mask"],
        num_classes, pooling=pooling,
        cls_token_index=backbone.cls_token_index, seed=seed, dropout=dropout)
    model = keras.Model(backbone.input, logits,
                        name=f"bert_classifier_{finetune}")
    return model, preprocessor


def _scratch_backbone(preprocessor, seed, dropout):
    """A `SCRATCH_SHAPE` BERT for `preprocessor`'s tokens, its weights a
    function of `seed` (nothing pretrained)."""
    import keras_hub  # Only the text models need it.

    # pylint: disable-next=protected-access
    with models._python_random_seed(seed):
        return keras_hub.models.BertBackbone(
            vocabulary_size=preprocessor.tokenizer.vocabulary_size(),
            max_sequence_length=preprocessor.sequence_length,
            dropout=dropout, **SCRATCH_SHAPE)


def _make_top_blocks_classifier(preset, num_classes, finetune,
                                sequence_length, lora_rank, seed, dropout,
                                blocks, pooling):
    """`make_classifier` that trains the top `blocks` blocks only."""
    model, preprocessor = models.make_text_classifier(
        preset, num_classes, sequence_length=sequence_length,
        trainable_layers=blocks, seed=seed, dropout=dropout,
        reinitialize=False, pooling=pooling)
    if finetune == "lora":
        import keras_hub  # Only the text models need it.

        # As keras-hub's `Backbone.enable_lora`, on these blocks only:
        # everything in them frozen but the targets' factors and biases.
        # pylint: disable-next=protected-access
        with models._python_random_seed(seed):
            for block in model.layers:
                if not isinstance(block,
                                  keras_hub.layers.TransformerEncoder):
                    continue
                # pylint: disable-next=protected-access
                sublayers = block._flatten_layers(include_self=False)
                for layer in sublayers:
                    layer.trainable = False
                # pylint: disable-next=protected-access
                for layer in block._flatten_layers(include_self=False):
                    if layer.name in LORA_TARGETS:
                        layer.trainable = True
                        layer.enable_lora(lora_rank)
    return model, preprocessor
