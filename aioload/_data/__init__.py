"""Reads and datasets: ``dataset`` (the split protocol, ``aioload.Dataset``: ``read`` for I/O,
``decode`` for CPU), ``reads`` (the one read core, wherever ``dataset.read`` runs: reads in
flight under a bound, each within ``read_timeout``, failures named, the stall meter),
``limiter`` (the resizable async bound on batches and reads in flight), ``strings``
(``aioload.StringList``: paths that forked workers share without copy-on-read) and ``synth``
(the generated default data: ``aioload.make_data``, a folder of ImageNet-like JPEGs).
"""
