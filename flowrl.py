"""FlowRL, trajectory balance with a learned log Z (Zhu et al. 2025, arXiv 2509.15207).

Placeholder: not built yet. Issue 3 builds this script (its toy, full-scale preset, notebook and tests).
"""
raise SystemExit("flowrl.py is not built yet: see issue 3")
