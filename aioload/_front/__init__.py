"""The front a user calls, in the order an epoch runs: ``loader`` (``aioload.DataLoader``:
torch's arguments, per-epoch plans, the worker pool's lifetime, ``__iter__``) hands each epoch
to ``iterator`` (the epoch fed by the engine, sync and async) or ``inprocess`` (the epoch
loaded in the caller's process), both built on ``epoch`` (one epoch as its iterator sees it);
``resources`` is what a loader must release, and when; ``compat`` holds torch's own
DataLoader warnings and the profiler range around each batch.
"""
