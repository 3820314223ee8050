"""lpt.data (under construction)."""
