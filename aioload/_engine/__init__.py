"""The engine: one epoch on its own thread and event loop, in the order data moves.

``engine`` (lifetime, permits, the sampler stage, the hand-off) composes the stages:
``reads`` (``dataset.read`` on the loop, when the workers do not read), ``decode`` (tasks to
the workers, the layout learned, batches assembled from slots), ``iterable`` (an
``IterableDataset`` epoch), ``executor`` (``executor=``: one task per batch on any
``concurrent.futures.Executor``; ``executor_process`` is what runs in the executor's
processes, ``daskplugin`` gives a Dask cluster's workers the dataset once each), ``gpudecode`` (``decode_device=``), and ``ready`` (the
bounded, reordering queue the consumer drains). ``spec`` holds the values an epoch is given
and hands back; ``lease`` is one batch's ownership of its slot and permit; ``stuck`` says
where a stuck epoch is held up; ``budget`` is ``on_error="skip"``.
"""
