"""Replay a workload against a pool and compare routing policies (`epp replay`)."""
