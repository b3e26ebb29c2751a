"""Tasks, toys, environments, rewards, checkers, tools and the sandbox the four scripts train on."""
