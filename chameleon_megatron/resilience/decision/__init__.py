"""The decision center (pure: plain data in, frozen plans out; no torch)."""
