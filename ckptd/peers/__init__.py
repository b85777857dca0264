"""Other nodes' daemons: the authenticated peer endpoint, the replicas held for them, and replication to a buddy."""
