"""Watching the loader: ``stats`` (counters, the frozen ``LoaderStats``, the verdict),
``memory`` (each process's PSS and private memory, copy-on-read named by the dataset's
attribute), ``monitor`` (log lines and progress bars) and ``tune`` (the autotuner of ``"auto"``
limits).
"""
