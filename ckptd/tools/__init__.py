"""What the command line shows and does besides the daemon: listings, export, control requests, the start options."""
