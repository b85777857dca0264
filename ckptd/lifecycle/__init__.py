"""Attempts at a checkpoint and their pipelines: ranks joining (attempt, contributors), admission, the disk pipeline (saves, commit, writer), the memory tier (snapshots, holding), slot maps."""
