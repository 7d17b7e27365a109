"""The framework layer: plain data, plugin interfaces, the plugin registry and the request
outcome record. It imports nothing else of smart-epp; every other layer builds on it."""
