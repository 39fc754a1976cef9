"""The hand-off: decoded samples written by workers straight into shared-memory batch slots.

``layout`` (slot geometry and where each leaf lives, used by both sides), ``writers`` (the
worker side), ``views`` (the parent side: batches as views of a slot), ``chunks`` (a worker
collating its chunk into the slot's columns), ``slots`` (the slot pool), ``shm`` (memfd
segments passed as file descriptors), ``shared`` (bytes a read received into a memfd, such
as window mode's shards, that workers map instead of receiving them pickled), ``tree`` (the one walker over nested samples),
``device`` (pinning and side-stream device copies).
"""
