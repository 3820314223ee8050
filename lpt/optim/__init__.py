"""lpt.optim (under construction)."""
