"""chameleon-run's side: the elastic agent, worker pool, node liveness, joins, relaunch."""
