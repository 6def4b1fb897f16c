"""torch.distributed execution: transports, shard store, reference parallel transformer. Never imports a solver."""
