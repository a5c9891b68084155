"""App schedulers for real tuners (Hyperband, curve stopping, Optuna) behind the narrow API of
paper Figure 8 (``agent.appsched``). They land with issue 5; the reference successive-halving,
curve-stopping and single-job schedulers the core needs live in ``agent.appsched``."""
