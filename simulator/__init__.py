"""The event-driven simulator: the virtual-clock shell around the same round engine, policies,
fairness and bidding code the service runs (``themis-sim``; see ``simulator.cli``)."""
