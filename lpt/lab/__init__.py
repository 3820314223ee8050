"""lpt.lab: the numerics lab.

``python -m lpt.lab [all|updates|gemm|attention|pqt|recipes|cost] --out DIR [--quick] [--recipes a,b]`` writes
DIR/REPORT.md and its plots (see ``lpt/lab/__main__.py`` and docs/lab.md).
"""
