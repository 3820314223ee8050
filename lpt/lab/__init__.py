"""lpt.lab (under construction)."""
