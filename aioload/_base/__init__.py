"""What every layer above shares: ``errors`` (the exceptions aioload raises, and the notes that
say where an error happened) and ``seeding`` (the seeds derived per epoch, worker and sample,
and the generators' states a worker captures and restores).
"""
