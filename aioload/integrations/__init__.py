"""Glue for training frameworks that need more than an iterable (see docs/integrations.md).

Each module imports its framework; import the one you use: ``aioload.integrations.accelerate``.
"""
