"""What runs beside the runtime rather than inside it: the `kiln` commands that read or drive a
plan (inspect, verify, generate, bench) and the gRPC client and load generator they use."""
