import kvstore.kernels_path  # noqa: F401  (`import kernels` is kvstore's, not Hugging Face's: see there)
