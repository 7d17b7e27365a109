"""smart-epp epp."""
