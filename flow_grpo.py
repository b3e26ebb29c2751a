"""Flow-GRPO for flow-matching image models (Liu et al. 2025, arXiv 2505.05470). Not AgentFlow's Flow-GRPO: that one is agentflow.py.

Placeholder: not built yet. Issue 4 builds this script (its toy, full-scale preset, notebook and tests).
"""
raise SystemExit("flow_grpo.py is not built yet: see issue 4")
