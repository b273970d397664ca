"""Neurons: the miner and validator processes, built from the core packages."""
