"""Exit statuses that workers, agents and whoever runs the launcher tell apart."""

CUT_OFF_EXIT = 75
"""The launcher's status when its node stopped because it is cut off from the job (sysexits'
EX_TEMPFAIL: the job goes on elsewhere, or may be resumed from its checkpoint)."""

WORKER_LEFT_EXIT = CUT_OFF_EXIT
"""A worker's status when the survivors declared it failed and went on without it (too slow
for a recovery's rendezvous): its agent tells it from a crash (``launch/agent.py``)."""
