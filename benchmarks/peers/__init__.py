"""One module per engine under test; each turns a Workload into a PeerResult."""
