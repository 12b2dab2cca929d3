"""Runnable experiments on top of `specjax`: prompt sets, runs and reports.

`experiments.bench.run_experiment(config)` is the library entry point that
`experiments/run.py` (absl) and notebooks call.
"""
