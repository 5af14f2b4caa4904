"""Executors: carry out a launch plan on this machine (local) or on a Ray cluster (ray); run tasks (tasks)."""
