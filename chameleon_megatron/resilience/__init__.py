"""Fault tolerance (paper B): decision center (pure planning) and recovery runtime."""
