"""LoRA training state that survives saving, checkpoints and resuming.

Keras 3 saves a LoRA layer (`layer.enable_lora(rank)`) for inference: its
`save_own_variables` writes the kernel with the low-rank update merged in
and no factors, and `load_own_variables` sets both factors A and B to zero.
Resuming LoRA training from such a checkpoint would be silently wrong: with
A = B = 0 both factors' gradients are zero, so LoRA never trains again. A
model rebuilt from its config also loses LoRA itself (keras-hub layers build
their projections in `build`, without the rank) and the frozen flags that
`enable_lora` set on nested layers.

A private model therefore records, in its config, which layers have LoRA
(`lora_config`) and which of the wrapped model's variables are trainable,
re-enables LoRA and the flags when it is rebuilt (`restore_lora`), and keeps
an extra saveable, `LoraFactors`, that writes each LoRA layer's own
variables unmerged (the frozen kernel, the bias, A and B) and restores them
after Keras has loaded the layers (Keras visits private attributes last).
"""

from tf_dpadam.common import compat


def lora_layers(model):
    """`[(index, layer)]` of `model`'s LoRA layers, by their index in
    `compat.all_layers(model)` (the same for a rebuilt copy)."""
    return [(i, layer)
            for i, layer in enumerate(compat.all_layers(model))
            if getattr(layer, "lora_enabled", False)]


def lora_config(model):
    """What `restore_lora` needs to rebuild `model`'s LoRA state (None when
    `model` has no LoRA layer): JSON-serializable."""
    layers = lora_layers(model)
    if not layers:
        return None
    weights = model.weights
    return {
        "layers": [[i, layer.lora_rank, layer.lora_alpha]
                   for i, layer in layers],
        "trainable": [i for i, v in enumerate(weights) if v.trainable],
        "num_weights": len(weights),
    }


def restore_lora(model, config):
    """Re-enables LoRA and the trainable flags of `lora_config` on `model`,
    a copy rebuilt from the config of the model it was taken from.

    Raises:
        ValueError: if `model`'s layers or weights do not match the record.
    """
    if not config:
        return
    layers = compat.all_layers(model)
    for index, rank, alpha in config["layers"]:
        if index >= len(layers) or not hasattr(layers[index],
                                               "enable_lora"):
            raise ValueError(
                f"Cannot restore LoRA: layer {index} of the rebuilt"
                f" {model.name!r} is not a layer that supports LoRA."
            )
        if not layers[index].lora_enabled:
            layers[index].enable_lora(rank, lora_alpha=alpha)
    weights = model.weights
    if len(weights) != config["num_weights"]:
        raise ValueError(
            f"Cannot restore LoRA: the rebuilt {model.name!r} has"
            f" {len(weights)} weights, the saved one had"
            f" {config['num_weights']}."
        )
    trainable = set(config["trainable"])
    for i, variable in enumerate(weights):
        variable.trainable = i in trainable


class LoraFactors(compat.KerasSaveable):
    """Saves and restores the unmerged variables of `model`'s LoRA layers.

    Held by a private model under a private attribute name, so that Keras
    saves and loads it after the model's layers (whose loading zeroes the
    factors).
    """

    def __init__(self, model):
        # A function, not the model itself: the saver walks attributes.
        self._find = lambda: lora_layers(model)

    def _obj_type(self):
        # A type Keras knows; it only picks the attributes the saver skips.
        return "Loss"

    def save_own_variables(self, store):
        for index, layer in self._find():
            for j, variable in enumerate(layer.weights):
                store[f"{index}_{j}"] = variable.numpy()

    def load_own_variables(self, store):
        for index, layer in self._find():
            for j, variable in enumerate(layer.weights):
                key = f"{index}_{j}"
                if key not in store:
                    raise ValueError(
                        f"The saved model has no LoRA state for layer"
                        f" {layer.name!r} (saved by an older tf_dpadam, or"
                        " LoRA was enabled after saving): its factors"
                        " cannot be restored."
                    )
                variable.assign(store[key])
