"""smart-epp scorers."""
