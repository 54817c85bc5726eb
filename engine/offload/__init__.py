"""Expert offload: host-resident experts with a device cache, and the SpecMoE-style self-drafter."""
