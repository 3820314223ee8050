"""lpt.train (under construction)."""
