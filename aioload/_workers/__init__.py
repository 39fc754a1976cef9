"""The worker processes: ``pool`` (start, dispatch, crash detection; the process boundary),
``template`` (with ``spawn`` or ``forkserver``, the one process that unpickles the dataset and
forks every worker), ``worker`` (the process's loop: tasks in, rows out), ``reads`` (``dataset.read`` on the
worker's own event loop), ``fetches`` (window mode's shards received by a worker and handed to
the training process as memfds), ``state`` (the Stateful protocol for a worker's copy of an
``IterableDataset``: its state captured after each batch, given back on resume), ``stacks`` (every
thread's Python stack of a worker, taken from outside it for the stuck report), ``messages``
(every message between the two sides, typed) and
``wire`` (their framing on a socket).
``parent`` makes a worker (or the bench's server) end with the process it serves.
"""
