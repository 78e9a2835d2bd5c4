"""Fault tolerance (paper B): when a rank fails, the survivors keep training.

Sub-packages, from the bottom up (each imports only those listed before it):

* ``decision``: the decision center, pure (no torch): layouts, profiles, the performance
  model, the planner, the selector, the restorer's plan, the recovery decision.
* ``store``: the job store's protocol, spoken by launch agents and workers alike:
  announcements, heartbeats (files its agent reads), join ids, the join queue, exit
  statuses.
* ``execution``: running a layout that megatron's parallel state cannot express
  (heterogeneous pipelines, data rerouting) as a trainer step engine.
* ``recovery``: in the job: detection, the recovery controller, regrouping, state transfer,
  the trainer plugin.
* ``launch``: ``chameleon-run``'s side: the elastic agent, its worker pool, node liveness,
  joining nodes, and relaunching after the job store is lost.
"""
