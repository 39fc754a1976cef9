"""What every layer above shares: ``errors`` (the exceptions aioload raises, and the notes that
say where an error happened) and ``seeding`` (the seeds derived per epoch, worker and sample,
and the generators' states a worker captures and restores) and ``walk`` (a bounded walk over
what a dataset holds: its large Python containers for the copy-on-read report, its caches for
the cache figures).
"""
