"""Developer tools of the repository (not part of the tf_dpadam package)."""
