"""The daemon's loop and process: the socket and dispatch (server), the worker pools, replies, events, node state, stats and metrics, configuration, the daemon process and load leases."""
