"""The event-driven simulator: the virtual-clock shell around the same round engine, policies,
fairness and bidding code the service runs. It lands with issue 3; until then ``themis-demo``
(``arbiter/demo.py``) is the main job."""
