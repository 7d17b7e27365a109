"""Built-in EndpointPickerConfig files (default, gie-default, llmd-precise,
default-flow-control)."""
