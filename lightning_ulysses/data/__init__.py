"""The data path: cutting each batch into this rank's sequence shard, and the layers the strategy adds to the
DataLoaders."""
