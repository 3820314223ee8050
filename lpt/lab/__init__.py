"""lpt.lab: the numerics lab. ``python -m lpt.lab [all|updates] --out DIR [--quick]`` writes DIR/REPORT.md."""
