"""lpt.models (under construction)."""
