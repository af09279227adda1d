"""The capacity simulator (`octavo simulate`): a fleet of replicas, each
running Octavo's real scheduler on a simulated clock, with step times from a
cost model fitted to this machine's measured steps. Torch-free; see
docs/SIMULATOR.md."""
