"""What every stage uses and that knows no stage: argument checks
(`validation`), tf_dpadam's one contact with private Keras and TensorFlow
APIs (`compat`), one-line command-line errors (`command_line`) and the
secret seeds of the noise and of sampling (`seeds`).

The stages, with arrows one way (`tests/architecture_test.py`):

    common -> accounting -> data ---------------------------.
    common -> privatizer -> optimizers -> training -> tools
                                              ^--- data, accounting

A module imports only from its own stage and the stages before it.
"""
