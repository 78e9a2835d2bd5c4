"""Cluster-scale failure simulator (traces, strategies, baselines)."""
