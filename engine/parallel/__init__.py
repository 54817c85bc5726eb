"""Expert parallelism: placement, all_to_all dispatch/combine over torch.distributed, the torchrun entry point."""
