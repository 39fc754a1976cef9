"""Watching the loader: ``stats`` (counters, the frozen ``LoaderStats``, the verdict),
``monitor`` (log lines and progress bars) and ``tune`` (the autotuner of ``"auto"`` limits).
"""
