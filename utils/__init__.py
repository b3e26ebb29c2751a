"""Run plumbing for the four scripts: models, logging and checkpoints, sweeps, sampling."""
