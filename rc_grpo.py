"""RC-GRPO, reward-conditioned GRPO for multi-turn tool calling (Zhong et al. 2026, arXiv 2602.03025).

Placeholder: not built yet. Issue 5 builds this script (its toy, full-scale preset, notebook and tests).
"""
raise SystemExit("rc_grpo.py is not built yet: see issue 5")
