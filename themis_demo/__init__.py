"""Demonstrations that need both sides of the wire: an arbiter and the agents that talk to it.

They sit a floor above ``arbiter`` and ``agent`` (issue 12, item 7): the arbiter package depends
on neither the agent package nor this one, except for ``themis-arbiter demo``, which loads
:mod:`themis_demo.service` only when asked.
"""
