"""Mixing datasets by weight: ``aioload.Mix``.

``weights`` the weights a mix is given (checked) and the schedule of changes an
epoch has seen; ``interleave`` which source the k-th sample of an epoch comes from and which of
that source's samples it is, a pure function of the seed, the epoch and the schedule;
``dataset`` the dataset over named sources, its reads and decodes passed to each source;
``tally`` the samples delivered from each source (``loader.stats().per_source``).
"""
