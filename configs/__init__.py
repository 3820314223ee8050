"""The shipped run configs: one file per run, ``get_config() -> ml_collections.ConfigDict``.

``python -m lpt.train --config tiny_cpu`` (a name) or ``--config configs/tiny_cpu.py`` (a path). In an installed
wheel this folder is the package ``lpt.configs``.
"""
