"""State several pickers of one pool share: in-flight load and routed prefixes."""
