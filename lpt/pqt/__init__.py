"""lpt.pqt (under construction)."""
