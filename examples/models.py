"""Models of the examples: the paper's CNN (a BERT classifier comes later)."""

import keras


def make_cnn(input_shape, num_classes):
    """The paper's 5-layer CNN: tanh convs, no normalization, logits out.

    conv 3x3 with 32, 64, 128 and 256 filters (a 2x2 max-pool after each of
    the first three), a last 3x3 conv to `num_classes` filters, and global
    average pooling.
    """
    layers = [keras.Input(input_shape)]
    for i, filters in enumerate((32, 64, 128, 256)):
        layers.append(keras.layers.Conv2D(
            filters, 3, padding="same", activation="tanh"))
        if i < 3:
            layers.append(keras.layers.MaxPooling2D(2))
    layers += [
        keras.layers.Conv2D(num_classes, 3, padding="same"),
        keras.layers.GlobalAveragePooling2D(),
    ]
    return keras.Sequential(layers, name="paper_cnn")
