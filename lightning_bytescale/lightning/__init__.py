"""The Lightning floor: the strategy, its launcher, the data module and the callbacks.

Everything here may import Lightning and every floor below it (``engine``, ``attention``,
``offload``, ``data``, ``models``, ``planner``, ``sim``); nothing below imports this floor.
See ``docs/architecture.md``.
"""
