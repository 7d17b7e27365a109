"""Workload definitions shipped with the replay benchmark (YAML)."""
