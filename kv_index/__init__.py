"""smart-epp kv_index."""
