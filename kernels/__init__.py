"""EdgeLoop kernels."""
