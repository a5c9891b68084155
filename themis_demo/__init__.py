"""Demonstrations that need both sides of the wire: an arbiter and the agents that talk to it.

They sit a layer above ``arbiter`` and ``agent``: the arbiter package imports neither the agent
package nor this one (``tests/test_layers.py``); ``themis-arbiter demo`` runs
:mod:`themis_demo.service` as its own program.
"""
