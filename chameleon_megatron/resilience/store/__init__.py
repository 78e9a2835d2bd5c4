"""The job store's protocol, shared by launch agents and workers."""
