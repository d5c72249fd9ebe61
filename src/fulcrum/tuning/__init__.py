"""Finding the balance: `fulcrum profile`, `fulcrum quantize` and `fulcrum tune`, and the config
writer they share. Client side: these talk to a backend directly or to a server over HTTP."""
