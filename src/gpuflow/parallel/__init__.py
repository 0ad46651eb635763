"""Scale-out on torch.distributed: process groups, the elastic launcher, DDP and FSDP2."""
