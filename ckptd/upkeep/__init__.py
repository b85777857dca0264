"""Background upkeep: retention, the start-up sweep, the mirror's uploads."""
