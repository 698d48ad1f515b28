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

LoRA and full fine-tuning keep the pretrained weights (nothing is
re-initialized) and put the head on the final [CLS] state, as last-block
does.
"""

import keras

from examples import models

FINETUNE_MODES = ("last_block", "lora", "full")
# The attention projections of a keras-hub BERT block.
LORA_TARGETS = ("query", "key", "value", "attention_output")


def check_finetune(finetune, lora_rank):
    """Raises a ValueError naming the bad argument."""
    if finetune not in FINETUNE_MODES:
        raise ValueError(
            f"Expected finetune={finetune!r} to be one of {FINETUNE_MODES}.")
    if not isinstance(lora_rank, int) or lora_rank < 1:
        raise ValueError(
            f"Expected lora_rank={lora_rank!r} to be a positive integer.")


def make_classifier(preset, num_classes, finetune="last_block",
                    sequence_length=128, lora_rank=8, seed=0, dropout=0.1):
    """`(model, preprocessor)`: a BERT classifier that trains `finetune`.

    Args:
        preset, num_classes, sequence_length, seed, dropout: as for
            `models.make_text_classifier` (`preset` may be a built
            `(backbone, preprocessor)` pair).
        finetune: "last_block", "lora" or "full" (module docstring).
        lora_rank: the rank of the LoRA factors ("lora" only).

    Returns:
        The model maps the preprocessor's token dict to logits. For "lora"
        and "full" it is a functional model on the backbone's own layers
        (not a nested backbone), so a private model saves and reloads it
        with its LoRA factors and frozen flags (`tf_dpadam.lora_state`).
    """
    check_finetune(finetune, lora_rank)
    if finetune == "last_block":
        return models.make_text_classifier(
            preset, num_classes, sequence_length=sequence_length, seed=seed,
            dropout=dropout)
    if isinstance(preset, (tuple, list)):
        backbone, preprocessor = preset
    else:
        backbone, preprocessor = models.load_bert(preset, sequence_length)
    if finetune == "lora":
        # The factors' initializers draw from Python's `random`: seed it.
        # pylint: disable-next=protected-access
        with models._python_random_seed(seed):
            backbone.enable_lora(lora_rank,
                                 target_layer_names=list(LORA_TARGETS))
    else:
        backbone.trainable = True
    sequence = backbone.output["sequence_output"]
    cls = sequence[:, backbone.cls_token_index, :]
    cls = keras.layers.Dropout(dropout, seed=seed, name="head_dropout")(cls)
    logits = keras.layers.Dense(
        num_classes,
        kernel_initializer=keras.initializers.TruncatedNormal(
            stddev=0.02, seed=seed),
        name="head",
    )(cls)
    model = keras.Model(backbone.input, logits,
                        name=f"bert_classifier_{finetune}")
    return model, preprocessor
