"""tf_dpadam: bias-corrected DP-Adam for TensorFlow / Keras 3."""

import setuptools

setuptools.setup(
    name="tf_dpadam",
    version="0.1.0",
    description=(
        "Differentially private training for Keras 3 with the bias-corrected"
        " DP-Adam of Tang & Lecuyer (DP-AdamBC)."
    ),
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=setuptools.find_packages(include=["tf_dpadam", "tf_dpadam.*"]),
    python_requires=">=3.10",
    install_requires=[
        # Only the versions the tests run on (requirements_lock.txt): the
        # code relies on private APIs of TF 2.21 and Keras 3.15 (see
        # tf_dpadam/compat.py, tf_dpadam/vectorization.py), and
        # tests/versions_test.py keeps this range, the lock and the
        # installed versions together.
        "tensorflow>=2.21,<2.22",
        "keras>=3.15,<3.16",
        "dp-accounting>=0.4.3",
        "absl-py",
        "numpy",
    ],
    extras_require={
        "tests": ["pytest", "scipy", "array-record"],
        "examples": [
            "tensorflow-datasets",
            # tensorflow-datasets imports it through etils (its `epath`
            # extra no longer installs it): without it `tfds.builder` fails.
            "importlib_resources",
            # tf.summary's implementation, for --tensorboard_dir.
            "tensorboard",
            "keras-hub",
            "matplotlib",
            "safetensors",
        ],
    },
)
