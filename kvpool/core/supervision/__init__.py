"""Processes' lives: when to restart one, whether a backend is healthy, whether
a service's memory fits its host, and which faults a chaos run injects.
"""
