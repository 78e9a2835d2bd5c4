"""Seams into megatron-core: platform patches, schedule wrappers, process groups, state."""
