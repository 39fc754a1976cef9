"""The worker processes: ``pool`` (start, dispatch, crash detection; the process boundary),
``worker`` (the process's loop: tasks in, rows out), ``reads`` (``dataset.read`` on the
worker's own event loop), ``messages`` (every message between the two sides, typed) and
``wire`` (their framing on a socket).
"""
