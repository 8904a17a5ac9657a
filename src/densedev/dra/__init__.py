"""Dynamic Resource Allocation: the same engine's pools served as ResourceSlices and DRA claims."""
