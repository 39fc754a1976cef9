"""The hand-off: decoded samples written by workers straight into shared-memory batch slots.

``layout`` (slot geometry and where each leaf lives, used by both sides), ``writers`` (the
worker side), ``views`` (the parent side: batches as views of a slot), ``chunks`` (a worker
collating its chunk into the slot's columns), ``slots`` (the slot pool), ``shm`` (memfd
segments passed as file descriptors), ``tree`` (the one walker over nested samples),
``device`` (pinning and side-stream device copies).
"""
