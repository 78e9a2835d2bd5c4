"""Environment variables the chameleon-run launcher sets in its workers (no torch import)."""

AGENT_ENV = "CHAMELEON_FT_AGENT"
"""Set (to "1") in the environment of workers started by the chameleon-run agent."""
RELAUNCH_ENV = "CHAMELEON_FT_RELAUNCH"
"""Set in the workers of a job relaunched after the store was lost: how many times so far."""
JOIN_ENV = "CHAMELEON_FT_JOIN_ID"
"""Set in a worker started to join a running job: its launch-rank id."""
