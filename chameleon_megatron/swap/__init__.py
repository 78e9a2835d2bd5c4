"""Activation swapping (paper A): online profiler, policy generator, executor, manager."""
