"""Reward service: scores completions in worker processes with deadlines (docs/reward.md)."""
