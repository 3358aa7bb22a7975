"""The reading side: following the log, sharing it on a node, fetching and resharding slices."""
