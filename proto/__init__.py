"""smart-epp proto."""
