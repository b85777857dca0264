"""What the command line shows and does besides the daemon: listings, export, rendering, control requests, the start options."""
