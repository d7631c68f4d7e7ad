"""Planning before any GPU hour: training memory, inference memory, FLOPs, the machine's resources, input preflight."""
