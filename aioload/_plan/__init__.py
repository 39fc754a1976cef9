"""The epoch plan, computed: which samples an epoch visits, on which rank, and what is left of it.

``order`` the epoch's order over every rank (a dataset's own ``epoch_order`` or a seeded
permutation); ``deal`` this rank's share of it, cut into batches of equal count on every rank;
``elastic`` what is left of an epoch after batches delivered on one number of ranks, dealt
again on another.
``sampling`` (the planner: index batches from torch's samplers or the plan above, dealt by rank,
with the epoch's progress), ``resume`` (the saved state of a loader: ``loader.state_dict()``,
written and checked field by field) and ``stateful`` (the Stateful protocol on the loader's
side: each ``IterableDataset`` copy's state as of the last delivered batch) make and keep the
plan of each epoch.
"""
