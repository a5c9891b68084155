"""The wire contract between agents and the arbiter.

``messages`` holds the plain Python values the contract carries (offers and bid tables); the
simulator passes these objects directly, the service (issue 4) carries them in ``themis.proto``.
"""
