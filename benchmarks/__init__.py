"""smart-epp benchmarks."""
