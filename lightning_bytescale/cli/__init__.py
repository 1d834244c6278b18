"""The command lines: ``bytescale-plan``, ``bytescale-sim``, ``bytescale-profile``, ``bytescale-data``
and ``bytescale-train``.

The top floor: a command line may import any floor.  ``plan`` and ``sim`` import only the pure
floors (no torch, no Lightning) so that they start in a fraction of a second.
"""
