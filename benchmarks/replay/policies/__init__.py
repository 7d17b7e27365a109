"""Routing policies of peer gateways, expressed as smart-epp `Scheduler`s so the replay
simulation drives every policy, smart-epp's own included, through the same interface."""
