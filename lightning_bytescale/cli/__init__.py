"""The command lines: ``bytescale-plan``, ``bytescale-sim``, ``bytescale-profile``, ``bytescale-data``
and ``bytescale-train``.

The top floor: a command line may import any floor.  ``plan`` and ``sim`` import only the pure
floors (no torch, no Lightning) so that they start in a fraction of a second.

Each command line is the ``main`` function of its module (``lightning_bytescale.cli.plan:main``
and so on, the console scripts in ``pyproject.toml``); the package itself exports nothing.
"""

__all__: list[str] = []
