"""lpt.kernels (under construction)."""
