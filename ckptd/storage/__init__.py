"""The storage seam: its contract, checkpoints on a filesystem and on an object store, the router between them, owner markers, and reading through the seam."""
