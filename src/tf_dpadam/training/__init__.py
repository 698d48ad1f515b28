"""The Keras glue: `make_private`, the private train step and `fit`.

`private_model.PrivateModel` wraps a user's model; its train step
(`train_step`) computes the clipped sum with the privatizer, then
`update` noises it once per logical step (gradient accumulation and
replicas included), hands the private gradient and Phi to the DP optimizer,
and counts the step in the model's privacy ledger (`model_ledger`).
`private_fit` draws the batches of `fit` (Poisson by default), `callbacks`
reports the ledger's epsilon, `independence` refuses models whose examples
mix, `hooks` lets audits and diagnostics observe the step.
"""
