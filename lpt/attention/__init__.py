"""lpt.attention (under construction)."""
