"""The ``aioload`` command and what it runs: ``cli``, ``bench`` (side by side with torch's
DataLoader) with ``benchhttp``/``benchserver``/``benchplot``, and ``synth`` (the generated
default data).
"""
