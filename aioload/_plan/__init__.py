"""The epoch plan, computed: which samples an epoch visits, on which rank, and what is left of it.

``order`` the epoch's order over every rank (a dataset's own ``epoch_order`` or a seeded
permutation); ``deal`` this rank's share of it, cut into batches of equal count on every rank;
``elastic`` what is left of an epoch after batches delivered on one number of ranks, dealt
again on another.
"""
