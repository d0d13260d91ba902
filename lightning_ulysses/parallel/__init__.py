"""The sequence-parallel layout and the exchanges: the DP×SP mesh and groups, where every token lives, the all-to-alls
around attention, ring attention."""
