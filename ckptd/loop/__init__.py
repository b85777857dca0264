"""The roof: the loop that serves one node (the socket and dispatch: server) and the daemon process around it (daemon). It imports every folder below it; none imports it."""
