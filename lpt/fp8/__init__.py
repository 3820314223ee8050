"""lpt.fp8 (under construction)."""
