"""AgentFlow's Flow-GRPO: the planner of a multi-turn agent (Li et al. 2025, arXiv 2510.05592). Not the image Flow-GRPO: that one is flow_grpo.py.

Placeholder: not built yet. Issue 6 builds this script (its toy, full-scale preset, notebook and tests).
"""
raise SystemExit("agentflow.py is not built yet: see issue 6")
