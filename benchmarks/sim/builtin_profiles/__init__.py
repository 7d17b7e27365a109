"""Built-in latency profiles, one YAML file each (schema: ``benchmarks/sim/profiles.py``)."""
