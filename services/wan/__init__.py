"""WAN emulation for benchmarks: stages in network namespaces behind tbf-capped veths, with a
user-space forwarder adding the one-way delay netem would (this kernel has no netem)."""
