"""Tools around a private model, built on the stages below it: the audit
(`audit`), membership inference (`membership`), moment diagnostics
(`diagnostics`), `validate` and `fix` (`fixer`), per-example gradient
norms for choosing C (`gradient_norms`), and resumable run folders whose
epsilon comes from the ledger their checkpoints carry (`run_dir`,
`run_files`, `run_ledger`).
"""
